# The two entry points the README promises. Both bootstrap .venv themselves.
.PHONY: demo test lint clean

demo:
	scripts/bootstrap.sh
	scripts/demo.sh $(if $(KEEP),--keep)

# Two workers: most tests wait on real daemons and subprocesses, so two nearly halve the
# wall clock even on a 2-core machine (8.4 -> 4.5 min when the suite was smaller). Three were
# a minute faster with the framework integrations (7.2 against 8.4 min) but loaded two cores
# enough to break a test's timing: two it stays. Every test has its own daemon instance,
# socket and directories; the few that look at node-wide leftovers (marked node_wide) run
# afterwards, alone. A worker takes a whole test file at a time, the slowest files first
# (tests/durations.json; tests/conftest.py says why): a module's shared fixtures are built
# once, and no long file starts last. `--write-durations` on the first command renews it.
test:
	scripts/bootstrap.sh --test
	.venv/bin/python -m pytest -n $${SHMSTAGE_TEST_WORKERS:-2} --dist loadfile \
		--no-loadscope-reorder -m "not node_wide"
	.venv/bin/python -m pytest -m node_wide

lint:
	scripts/bootstrap.sh --test
	.venv/bin/ruff check .

# Remove what the commands above made: the virtualenv and demo leftovers of earlier runs.
clean:
	rm -rf .venv
	rm -rf "$${TMPDIR:-/tmp}"/shmstage-demo.*
