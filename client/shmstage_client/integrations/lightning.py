"""Lightning through shmstage: ``Trainer(plugins=[ShmStageCheckpointIO()])``.

Lightning hands every checkpoint to its ``CheckpointIO`` as one dict: the model's and the
optimizers' state (large tensors) beside the loops, the callbacks' states, the
hyper-parameters and whatever ``on_save_checkpoint`` added (anything picklable).
``ShmStageCheckpointIO`` saves the large tensors through a ``Stager`` and everything else,
pickled as ``torch.save`` would, as one more tensor of the same checkpoint — so a
checkpoint is one shmstage directory at the path Lightning asked for (``epoch=0-step=10.ckpt``
is a directory), it appears only once complete, a restart restores it from the daemon's
memory, and every non-tensor part comes back exactly as it went in (see ``pack``).

``ModelCheckpoint`` works unchanged. It saves ``last.ckpt`` again and again at the same
path, and may save a top-k path that a removal has not yet freed: such a save goes to a
hidden sibling and, once durable, is exchanged with what the path held in one atomic
``renameat2(RENAME_EXCHANGE)`` — so ``last.ckpt`` always names a complete checkpoint, the
previous one until the new one is durable. Removals of a checkpoint still being written
wait for it behind the save on one background thread (``_Finisher``): the training loop
never waits for a removal, and nothing is ever removed half-written.

Sharded FSDP (``FSDPStrategy(state_dict_type="sharded")``) calls PyTorch DCP itself and
never reaches a ``CheckpointIO``: ``ShmStageFSDPStrategy`` is that strategy with its DCP
calls going through ``shmstage_client.dcp`` instead.

Lightning itself is imported only when one of these classes is first used, so importing
this module costs nothing; without Lightning that use raises ImportError naming the extra
to install. Both namespaces work: ``lightning.pytorch`` and ``pytorch_lightning``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import importlib
import io
import itertools
import logging
import os
import shutil
import stat
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shmstage import listing
from shmstage.checkpoint import CheckpointError
from shmstage.manifest import MANIFEST_NAME
from shmstage_client.dtypes import safetensors_name
from shmstage_client.errors import SaveTimeout
from shmstage_client.processes import alive
from shmstage_client.restore.files import CheckpointFiles
from shmstage_client.restore.restoring import Restored, check_source, restore
from shmstage_client.save.handle import SaveHandle
from shmstage_client.save.stager import Stager

log = logging.getLogger("shmstage.lightning")

if TYPE_CHECKING:  # made on first use (``__getattr__``): Lightning is imported then
    ShmStageCheckpointIO: type
    ShmStageFSDPStrategy: type
    ShmStageModelParallelStrategy: type

__all__ = [
    "INSTALL_HINT",
    "ShmStageCheckpointIO",
    "ShmStageFSDPStrategy",
    "ShmStageModelParallelStrategy",
    "pack",
    "unpack",
]

INSTALL_HINT: Final = "pip install 'shmstage-client[lightning]'"

#: The top-level entries whose tensors are staged as tensors: the model's and the
#: optimizers' state, whose structure is the same at every save (so the staging layout is
#: reused). Tensors anywhere else (a callback's best score, keyed by a path that changes
#: with every save) are pickled with the rest.
TENSOR_SECTIONS: Final = ("state_dict", "optimizer_states")
#: The staged state dict: {TENSORS: {name: tensor}, PICKLED: uint8 tensor}.
TENSORS: Final = "tensors"
PICKLED: Final = "lightning"
#: The pickled part's tensor holds an 8-byte length, the pickle, then zeros up to a power
#: of two (at least this): a callback state that grows by a few bytes keeps the layout.
MIN_PICKLED_BYTES: Final = 64 * 1024
_LENGTH = struct.Struct("<Q")
#: The manifest's metadata says what wrote the checkpoint.
FORMAT: Final = "shmstage-lightning/1"
#: How long a load or a teardown waits for this process's saves still being written.
WAIT_TIMEOUT_S: Final = 600.0


# -- the checkpoint dict, split for staging ------------------------------------------------


def pack(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The state dict a Stager saves for a Lightning ``checkpoint``.

    The tensors of ``TENSOR_SECTIONS`` reached through dicts and lists are staged under
    their path (``state_dict/layer.weight``, ``optimizer_states/0/state/0/exp_avg``); the
    rest of the dict, with those tensors left out and where they were recorded, is pickled
    by ``torch.save`` into one uint8 tensor. Why pickle: Lightning's checkpoint holds
    whatever a callback or a hyper-parameter is (tuples, Namespaces, dtypes, paths, small
    tensors keyed by file names) and ``torch.load`` of the default ``CheckpointIO`` gives
    all of it back; shmstage's plain values hold only JSON-like ones. Nothing is copied:
    the staged tensors are the caller's, the Stager copies them.
    """
    tensors: dict[str, torch.Tensor] = {}
    places: list[tuple[str, tuple[str | int, ...]]] = []
    skeleton = dict(checkpoint)
    for section in TENSOR_SECTIONS:
        if section in skeleton:
            skeleton[section] = _lift(skeleton[section], (section,), tensors, places)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "checkpoint": skeleton, "places": places}, buffer)
    return {TENSORS: tensors, PICKLED: _pickled_tensor(buffer.getvalue())}


def unpack(
    state: dict[str, Any], map_location: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """The Lightning checkpoint that ``pack`` split into ``state``: the pickled part read
    with ``torch.load(map_location=, weights_only=)`` — as the default ``CheckpointIO``
    reads a ``.ckpt`` file — and each staged tensor put back where it was."""
    try:
        blob, tensors = state[PICKLED], state[TENSORS]
    except (KeyError, TypeError):
        raise CheckpointError(
            "not a checkpoint written by ShmStageCheckpointIO (no Lightning part in it); "
            "load it with shmstage_client.load(path)"
        ) from None
    data = _pickled_bytes(blob)
    pickled = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    if not isinstance(pickled, dict) or pickled.get("format") != FORMAT:
        raise CheckpointError(f"the checkpoint's Lightning part is not {FORMAT}")
    checkpoint = pickled["checkpoint"]
    for key, path in pickled["places"]:
        node = checkpoint
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = tensors[key]
    return checkpoint


def _lift(
    node: Any,
    path: tuple[str | int, ...],
    tensors: dict[str, torch.Tensor],
    places: list[tuple[str, tuple[str | int, ...]]],
) -> Any:
    """``node`` with its stageable tensors taken out (None in their place, recorded in
    ``places``); only plain dicts and lists are entered, so they can be rebuilt as they
    were: anything else (a tuple, a custom mapping) is pickled whole."""
    if _stageable(node):
        key = "/".join(str(part) for part in path)
        tensors[key] = node
        places.append((key, path))
        return None
    if type(node) in (dict, OrderedDict) and all(type(k) in (str, int) for k in node):
        copy = type(node)()
        for child, value in node.items():
            copy[child] = _lift(value, (*path, child), tensors, places)
        return copy
    if type(node) is list:
        return [_lift(value, (*path, i), tensors, places) for i, value in enumerate(node)]
    return node


def _stageable(value: Any) -> bool:
    """A dense tensor with data of a dtype safetensors stores; others are pickled."""
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout is torch.strided
        and not value.is_quantized
        and value.device.type != "meta"
        and safetensors_name(value.dtype) is not None
    )


def _pickled_tensor(data: bytes) -> torch.Tensor:
    size = max(MIN_PICKLED_BYTES, 1 << (_LENGTH.size + len(data) - 1).bit_length())
    buffer = bytearray(size)
    _LENGTH.pack_into(buffer, 0, len(data))
    buffer[_LENGTH.size : _LENGTH.size + len(data)] = data
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _pickled_bytes(blob: Any) -> bytes:
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise CheckpointError("the checkpoint's Lightning part is not a uint8 tensor")
    blob = blob.cpu().contiguous()
    (length,) = _LENGTH.unpack(ctypes.string_at(blob.data_ptr(), _LENGTH.size))
    if length > blob.numel() - _LENGTH.size:
        raise CheckpointError("the checkpoint's Lightning part is shorter than it says")
    return ctypes.string_at(blob.data_ptr() + _LENGTH.size, length)


# -- paths: replacing, removing -----------------------------------------------------------

RENAME_EXCHANGE: Final = 2
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28 and later
_AT_FDCWD: Final = -100
#: A save that replaces a path goes here first: ``.<name>.shmstage-replacing-<pid>-<n>``
#: (no ``.ckpt`` suffix, so ModelCheckpoint never lists it).
_REPLACING: Final = ".shmstage-replacing-"
_REMOVING: Final = ".shmstage-removing-"
_counter = itertools.count()


def _hidden(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}{what}{os.getpid()}-{next(_counter)}")


def install(new: Path, path: Path) -> None:
    """Put the complete checkpoint ``new`` at ``path`` and delete what ``path`` held.

    With ``renameat2(RENAME_EXCHANGE)`` the two swap in one step: a reader of ``path``
    finds the old checkpoint or the new one, never none and never a mix. Where the
    filesystem or C library refuses it (EINVAL, ENOSYS: some network filesystems, old
    kernels), the old one is moved aside first, so ``path`` is briefly absent — still
    never torn."""
    if os.path.lexists(path):
        if _renameat2 is not None:
            done = _renameat2(
                _AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(path), RENAME_EXCHANGE
            )
            if done == 0:
                _discard(new)  # what path held
                return
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(err, os.strerror(err), str(path))
        _discard(path)
    os.rename(new, path)


def remove(path: Path) -> None:
    """Delete the checkpoint at ``path``: a link only (``save_last="link"``), a file, or a
    directory — moved aside first, so that ``path`` never names a half-deleted one."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    _discard(path)


def _discard(path: Path) -> None:
    """Move ``path`` aside under a name nothing installs or lists, then delete it."""
    aside = _hidden(path, _REMOVING)
    os.rename(path, aside)
    _delete(aside)


def _delete(path: Path) -> None:
    """Delete ``path``; a checkpoint directory's manifest first, so that what a crash
    leaves half-deleted is never taken for a complete checkpoint."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / MANIFEST_NAME)
    shutil.rmtree(path)


def sweep(directory: Path) -> None:
    """Delete what a dead process of this project left hidden in ``directory``: a
    replacement it never installed, a removal it never finished (its pid is in the name)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        for marker in (_REPLACING, _REMOVING):
            if name.startswith(".") and marker in name and _ours(directory / name):
                pid = name.rsplit(marker, 1)[1].split("-", 1)[0]
                if pid.isdigit() and not alive(int(pid)):
                    with contextlib.suppress(OSError):
                        _delete(directory / name)


def _ours(path: Path) -> bool:
    """Whether ``path`` is this user's: another user's entries, even named like ours, are
    neither installed nor deleted."""
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except OSError:
        return False


def finish_replacements(path: Path, complete: str = MANIFEST_NAME) -> None:
    """Install the newest complete replacement of ``path`` that a dead process saved but
    did not live to install (killed between the save being durable and the exchange): its
    checkpoint is newer than what ``path`` names, and the process meant it to be there.
    One killed right after the exchange left the *older* checkpoint under that name (or
    part of it, its manifest deleted first): that one is older than ``path``'s, and only
    deleted. ``complete``: the file a complete checkpoint has (a DCP one: its marker)."""
    prefix = f".{path.name}{_REPLACING}"
    found: list[tuple[int, Path]] = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid, _, number = name[len(prefix) :].partition("-")
        leftover = path.parent / name
        if pid.isdigit() and number.isdigit() and _ours(leftover) and not alive(int(pid)):
            try:  # the newest: a complete one's manifest was written last
                written = os.stat(leftover / complete).st_mtime_ns
            except OSError:
                written = -1  # not complete: never installed
            found.append((written, int(number), leftover))
    found.sort()
    for *_, leftover in found[:-1]:
        with contextlib.suppress(OSError):
            _delete(leftover)
    try:
        current = os.stat(path / complete).st_mtime_ns
    except OSError:
        current = -1
    if found and found[-1][0] > current:  # not the older one an exchange put aside
        newest = found[-1][2]
        log.info("shmstage: installing %s, saved by a process that died before it could", newest)
        install(newest, path)



class _Waiting:
    """A future (DCP's ``async_save``) waited for as a ``SaveHandle`` is."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def wait(self, timeout: float | None = None) -> Any:
        return self.future.result(timeout)


class _Finisher:
    """What happens after a save, in save order, on one background thread: wait until it
    is durable, install a replacement, run removals that waited for it.

    One thread, first in first out, is the whole ordering argument: a removal or a
    replacement queued after a save runs after that save is settled. ``pending`` counts the
    saves of each path not yet settled, so a removal of a path with none runs at once."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="shmstage-lightning"
        )
        self._lock = threading.Lock()
        self.pending: dict[Path, int] = {}
        self.errors: list[BaseException] = []

    def busy(self, path: Path) -> bool:
        with self._lock:
            return self.pending.get(path, 0) > 0

    def after_save(
        self, handle: SaveHandle | _Waiting, path: Path, replacing: Path | None
    ) -> None:
        with self._lock:
            self.pending[path] = self.pending.get(path, 0) + 1
        self._pool.submit(self._settle, handle, path, replacing)

    def _settle(
        self, handle: SaveHandle | _Waiting, path: Path, replacing: Path | None
    ) -> None:
        try:
            handle.wait(WAIT_TIMEOUT_S)
            if replacing is not None:
                install(replacing, path)
        except BaseException as exc:  # surfaced by the next save, a load or teardown
            log.error("shmstage: the checkpoint %s was not written: %s", path, exc)
            self.errors.append(exc)
            if replacing is not None:
                with contextlib.suppress(OSError):
                    _delete(replacing)
        finally:
            with self._lock:
                self.pending[path] -= 1
                if not self.pending[path]:
                    del self.pending[path]

    def later(self, action: Callable[[], None]) -> None:
        self._pool.submit(self._run, action)

    def _run(self, action: Callable[[], None]) -> None:
        try:
            action()
        except BaseException as exc:
            log.error("shmstage: %s", exc)
            self.errors.append(exc)

    def drain(self, timeout: float) -> None:
        """Wait until everything queued so far has run."""
        marker = self._pool.submit(lambda: None)
        try:
            marker.result(timeout)
        except concurrent.futures.TimeoutError:
            raise SaveTimeout(
                f"checkpoints still being written after {timeout} s (shmstaged slow or "
                "stuck: see its log)"
            ) from None

    def raise_errors(self) -> None:
        if self.errors:
            first, self.errors = self.errors[0], []
            raise first

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# -- the CheckpointIO ---------------------------------------------------------------------


class _ShmStageCheckpointIO:
    """A Lightning ``CheckpointIO`` that saves through shmstaged and restores from its
    memory: ``Trainer(plugins=[ShmStageCheckpointIO()])``.

    ``socket``: the daemon's (default: ``$SHMSTAGE_SOCKET``, else the system's). ``slots``:
    staging slots (default: the daemon's; two let a save fill one while the previous
    checkpoint streams from the other — ``save_last=True`` saves twice per checkpoint, so
    give it three). ``block=False`` returns from a save once the copy of the optimizers'
    parameters and state has started, as ``Stager.save(block=False)`` does: the copy runs
    behind the next step's forward and backward (Lightning steps with a closure, and the
    guard waits after it, before the update). The guard is put on every optimizer that
    steps in this process once the plugin exists (a global step pre-hook notes them: a
    CheckpointIO is never told the Trainer's optimizers); saves before the first step are
    blocking. A trainer killed before such a copy reached the daemon leaves no checkpoint
    of that save (``last.ckpt`` then still names the one before). ``source``: where loads
    read ("auto": the daemon's memory when it holds exactly that checkpoint, else the
    files). ``trust_others``:
    load checkpoints that were not written for this user (another uid's, or in a directory
    others may change); by default they are refused, as ``latest()`` refuses them.

    ``last_restored``: how the last ``load_checkpoint`` came back (``.source`` is "memory"
    or "files"; None for a ``torch.save`` file). ``last_save``: the last save's
    ``SaveHandle`` (``.timings``: what it cost the step).
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        slots: int | None = None,
        block: bool = True,
        source: str = "auto",
        verify: bool = True,
        trust_others: bool = False,
    ) -> None:
        super().__init__()
        check_source(source)
        self.socket = socket
        self.slots = slots
        self.block = block
        self.source = source
        self.verify = verify
        self.trust_others = trust_others
        self.last_restored: Restored | None = None
        self.last_save: SaveHandle | None = None
        self._stager: Stager | None = None
        self._finisher: _Finisher | None = None
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._guarded: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._step_hook: Any = None
        self._swept: set[Path] = set()
        if not block:
            self._notice_optimizers()

    # Lightning's interface ------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage ``checkpoint`` and return; the daemon writes it to the directory ``path``,
        which appears once complete (or, when ``path`` exists or is still being written, is
        exchanged with it then)."""
        if storage_options is not None:
            raise TypeError(
                f"ShmStageCheckpointIO.save_checkpoint(storage_options={storage_options!r}): "
                "shmstage takes no storage options; save without them"
            )
        target = _local_path(path)
        finisher = self._open_finisher()
        finisher.raise_errors()
        stager = self._open_stager()
        if target.parent not in self._swept:
            target.parent.mkdir(parents=True, exist_ok=True)
            sweep(target.parent)
            self._swept.add(target.parent)
        replacing = None
        if os.path.lexists(target) or finisher.busy(target):
            replacing = _hidden(target, _REPLACING)
        block = self.block or not self._guard(stager)
        handle = stager.save(
            pack(checkpoint),
            replacing or target,
            metadata={"format": FORMAT, "path": str(target)},
            block=block,
        )
        finisher.after_save(handle, target, replacing)
        self.last_save = handle

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint at ``path``: from shmstaged's memory when it holds exactly that
        one, else from its files; a ``torch.save`` file (the default CheckpointIO's) is
        read as Lightning reads it. This process's own saves to ``path`` are waited for."""
        target = _local_path(path)
        if self._finisher is not None:
            self._finisher.drain(WAIT_TIMEOUT_S)
            self._finisher.raise_errors()
        try:
            finish_replacements(target)
        except OSError as exc:  # a directory this process may not change: read what is there
            log.warning("shmstage: could not finish a replacement of %s: %s", target, exc)
        resolved = Path(os.path.realpath(target))
        if not resolved.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        device = _device_of(map_location)
        if not resolved.is_dir():
            with open(resolved, "rb") as file:
                self._check_written_for(file.fileno(), resolved, None)
                self.last_restored = None
                return torch.load(file, map_location=map_location, weights_only=weights_only)
        fd = os.open(resolved, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            pinned = f"/proc/self/fd/{fd}"  # exactly the directory checked, whatever is renamed
            with CheckpointFiles(pinned) as files:
                self._check_written_for(fd, resolved, files)
            restored = restore(
                pinned, device, source=self.source, verify=self.verify, socket=self.socket
            )
        finally:
            os.close(fd)
        restored.path = resolved
        self.last_restored = restored
        log.info(
            "shmstage: restored %s from %s in %.3f s%s", path, restored.source,
            restored.seconds, f" ({restored.reason})" if restored.reason else "",
        )  # fmt: skip
        return unpack(restored.state, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` — once it is complete, if this process is still
        writing it (then in the background, after the save)."""
        target = _local_path(path)
        finisher = self._finisher
        if finisher is not None and finisher.busy(target):
            finisher.later(lambda: remove(target))
            return
        remove(target)

    def teardown(self) -> None:
        """Wait until every checkpoint of this process is durable (and installed), then let
        the daemon go: Lightning calls it at the end of ``fit``, ``validate``, ``test``."""
        finisher, self._finisher = self._finisher, None
        stager, self._stager = self._stager, None
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._guarded = weakref.WeakSet()
        try:
            if finisher is not None:
                finisher.drain(WAIT_TIMEOUT_S)
                finisher.close()
        finally:
            if stager is not None:
                stager.close()
        if finisher is not None:
            finisher.raise_errors()

    # the parts ---------------------------------------------------------------------------

    def _open_stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager(self.socket, slots=self.slots)
        return self._stager

    def _open_finisher(self) -> _Finisher:
        if self._finisher is None:
            self._finisher = _Finisher()
            if not self.block:
                self._notice_optimizers()
        return self._finisher

    def _notice_optimizers(self) -> None:
        """Note every optimizer that steps from now on: a CheckpointIO is never told the
        Trainer's, and the guard needs them."""
        if self._step_hook is None:
            seen = self._optimizers

            def note(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                seen.add(optimizer)

            self._step_hook = register_optimizer_step_pre_hook(note)

    def _guard(self, stager: Stager) -> bool:
        """Guard the optimizers noticed so far; whether any is guarded."""
        new = [opt for opt in self._optimizers if opt not in self._guarded]
        if new:
            stager.guard(*new)
            self._guarded.update(new)
        return len(self._guarded) > 0

    def _check_written_for(self, fd: int, path: Path, files: CheckpointFiles | None) -> None:
        """Refuse a checkpoint another user could have written (``listing.not_written_for``,
        the rule ``latest()`` applies), unless ``trust_others``: ``ckpt_path="last"`` picks
        the newest ``last*.ckpt`` in the directory, and in a directory others can write,
        that could be theirs."""
        if self.trust_others:
            return
        uid = os.geteuid()
        if files is not None:
            why = listing.not_written_for(uid, fd, files.manifest)
        else:
            st = os.fstat(fd)
            why = ""
            if st.st_uid != uid:
                why = f"the file belongs to uid {st.st_uid}, not uid {uid}"
            elif st.st_mode & 0o022:
                why = f"the file is writable by its group or others (mode {st.st_mode:o})"
        if not why:
            why = _parent_open_to_others(path, uid)
        if why:
            raise CheckpointError(
                f"{path} is not a checkpoint written for uid {uid}: {why}. Loading it could "
                "hand this run another user's bytes; if you trust it, pass "
                "ShmStageCheckpointIO(trust_others=True)"
            )


def _parent_open_to_others(path: Path, uid: int) -> str:
    """Why another user could put something else at ``path`` ("" when nobody can): its
    directory is writable by others without the sticky bit that keeps them off our entries."""
    try:
        st = os.stat(path.parent)
    except OSError as exc:
        return f"{path.parent}: {exc.strerror}"
    if st.st_uid not in (uid, 0) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        return (
            f"its directory {path.parent} (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}) "
            "lets another user replace it"
        )
    return ""


def _local_path(path: Any) -> Path:
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"{text}: shmstaged writes to a local or mounted filesystem; give a path, not a "
            "URL (or use Lightning's default CheckpointIO for remote storage)"
        )
    return Path(os.path.abspath(text.removeprefix("file://")))


def _device_of(map_location: Any) -> torch.device:
    """Where restored tensors go: a device named by ``map_location``, else the CPU (as the
    default CheckpointIO, whose default map_location keeps storages on the CPU)."""
    if isinstance(map_location, torch.device):
        return map_location
    if isinstance(map_location, str):
        return torch.device(map_location)
    return torch.device("cpu")


# -- lazy classes -------------------------------------------------------------------------

#: Where each Lightning namespace keeps the CheckpointIO base class.
_NAMESPACES: Final = (
    ("lightning", "lightning.fabric.plugins.io.checkpoint_io"),
    ("pytorch_lightning", "lightning_fabric.plugins.io.checkpoint_io"),
)
_built: dict[str, type] = {}


def _missing(what: str) -> ImportError:
    return ImportError(
        f"{what} needs Lightning (the lightning or pytorch_lightning package), which is not "
        f"installed: {INSTALL_HINT}"
    )


def _checkpoint_io_class() -> type:
    """``ShmStageCheckpointIO``: the implementation above, a ``CheckpointIO`` of every
    Lightning namespace installed (a Trainer checks plugins with ``isinstance`` against its
    own namespace's class, and both may be installed side by side)."""
    if "ShmStageCheckpointIO" not in _built:
        bases, missing = [], []
        for _, module in _NAMESPACES:
            try:
                bases.append(importlib.import_module(module).CheckpointIO)
            except ImportError as exc:
                missing.append(exc)
        if not bases:
            raise _missing("ShmStageCheckpointIO") from missing[0]
        _built["ShmStageCheckpointIO"] = type(
            "ShmStageCheckpointIO",
            (_ShmStageCheckpointIO, *bases),
            {"__module__": __name__, "__doc__": _ShmStageCheckpointIO.__doc__},
        )
    return _built["ShmStageCheckpointIO"]


# -- sharded strategies -------------------------------------------------------------------


class _ShmStageSharded:
    """What makes a Lightning strategy that saves sharded checkpoints with PyTorch DCP
    itself (``FSDPStrategy(state_dict_type="sharded")``, ``ModelParallelStrategy``) save
    them through ``shmstage_client.dcp`` instead.

    Lightning writes such a checkpoint as a directory of DCP files plus ``meta.pt`` (the
    rest of the checkpoint dict, ``torch.save``-d by rank 0 after the DCP save): a directory
    visible while it is written, its two parts published apart. Here the same state goes to
    ``dcp.save`` with a ``ShmStageWriter`` — every rank's shards staged and written by its
    node's shmstaged, the directory published atomically once every rank's part is durable
    — and the rest of the dict is one more (pickled) object of that same DCP checkpoint. A
    path that exists (``last.ckpt``) is saved beside it and exchanged with it by rank 0.
    The save is ``dcp.async_save`` on a gloo group of its own: it returns once every
    rank's shards are copied into shared memory; the exchange (rank 0), removals asked for
    meanwhile, the next save, a load and ``teardown`` wait for it behind one background
    thread, as ``ShmStageCheckpointIO`` does (Lightning's own saves here are synchronous).
    Loads read each rank's file from
    its daemon's memory when it holds it (``last_sources``: rank file -> "memory"/"files").
    Checkpoints of the strategy's other mode (full state dicts) go through its CheckpointIO
    as before — give it a ``ShmStageCheckpointIO``.
    """

    #: The key of the model's state in the DCP checkpoint: Lightning's own, per strategy.
    _shm_model_key = "model"

    def __init__(
        self,
        *args: Any,
        socket: str | os.PathLike[str] | None = None,
        slots: int | None = None,
        source: str = "auto",
        **kwargs: Any,
    ) -> None:
        check_source(source)
        super().__init__(*args, **kwargs)
        self.shmstage_socket = socket
        self.shmstage_source = source
        self._shm_slots = slots
        self._shm_writer: Any = None
        self._shm_group: Any = None
        self._shm_finisher: _Finisher | None = None
        self._shm_swept: set[Path] = set()
        self.last_sources: dict[int, str] = {}

    def _shm_sharded(self) -> bool:
        raise NotImplementedError

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._shm_sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options={storage_options!r}): "
                "shmstage takes no storage options; save without them"
            )
        import torch.distributed.checkpoint as dcp

        from shmstage_client.dcp import ShmStageWriter

        path = _local_path(self.broadcast(os.fspath(filepath)))
        target = path
        if self.is_global_zero:
            if not path.parent.exists():
                path.parent.mkdir(parents=True)
            elif path.parent not in self._shm_swept:
                sweep(path.parent)
            self._shm_swept.add(path.parent)
            if os.path.lexists(path):
                target = _hidden(path, _REPLACING)
        target = Path(self.broadcast(str(target)))
        state = {self._shm_model_key: checkpoint.pop("state_dict")}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optimizer_state
        rest = io.BytesIO()
        torch.save(checkpoint, rest)
        state[PICKLED] = rest.getvalue()
        if self._shm_writer is None:
            self._shm_writer = ShmStageWriter(socket=self.shmstage_socket, slots=self._shm_slots)
            self._shm_group = torch.distributed.new_group(backend="gloo")
            self._shm_finisher = _Finisher()
        finisher = self._shm_finisher
        finisher.drain(WAIT_TIMEOUT_S)  # one DCP save in flight per writer
        finisher.raise_errors()
        future = dcp.async_save(
            state, checkpoint_id=target, storage_writer=self._shm_writer,
            process_group=self._shm_group,
        )  # fmt: skip
        # Rank 0's future is done once every rank's part is durable and the checkpoint is
        # published (DCP's finish): only then may it take the place of what ``path`` held.
        finisher.after_save(
            _Waiting(future), path, target if self.is_global_zero and target != path else None
        )
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from shmstage_client.dcp import MARKER_NAME, ShmStageReader

        if self._shm_finisher is not None:
            self._shm_finisher.drain(WAIT_TIMEOUT_S)
            self._shm_finisher.raise_errors()
        if self.is_global_zero:
            target = _local_path(checkpoint_path)
            try:
                finish_replacements(target, MARKER_NAME)
            except OSError as exc:
                log.warning("shmstage: could not finish a replacement of %s: %s", target, exc)
        path = _local_path(self.broadcast(os.fspath(checkpoint_path)))
        if not (path / MARKER_NAME).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        self.last_sources = {}

        def reader() -> ShmStageReader:
            made = ShmStageReader(path, source=self.shmstage_source, socket=self.shmstage_socket)
            readers.append(made)
            return made

        readers: list[ShmStageReader] = []
        rest = self._shm_load_states(reader)
        for made in readers:
            self.last_sources.update(made.sources)
        return torch.load(io.BytesIO(rest), weights_only=weights_only)

    def _shm_load_states(self, reader: Callable[[], Any]) -> bytes:
        raise NotImplementedError

    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        target, finisher = _local_path(filepath), self._shm_finisher
        if finisher is not None and finisher.busy(target):
            finisher.later(lambda: remove(target))
        else:
            remove(target)

    def teardown(self) -> None:
        writer, self._shm_writer = self._shm_writer, None
        finisher, self._shm_finisher = self._shm_finisher, None
        try:
            if finisher is not None:
                finisher.drain(WAIT_TIMEOUT_S)
                finisher.close()
                finisher.raise_errors()
        finally:
            try:
                super().teardown()  # type: ignore[misc]
            finally:
                if writer is not None:
                    writer.close()


class _ModelParallelSharded(_ShmStageSharded):
    """``ModelParallelStrategy`` (FSDP2, tensor parallel): DTensor state dicts."""

    _shm_model_key = "state_dict"

    def _shm_sharded(self) -> bool:
        return bool(self._save_distributed_checkpoint)  # type: ignore[attr-defined]

    def _shm_load_states(self, reader: Callable[[], Any]) -> bytes:
        """What Lightning's ``_load_checkpoint`` does for a sharded checkpoint, with our
        reader: the model, then each optimizer, then the rest."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model  # type: ignore[attr-defined]
        strict = self.lightning_module.strict_loading  # type: ignore[attr-defined]
        state: dict[str, Any] = {self._shm_model_key: get_model_state_dict(module), PICKLED: b""}
        dcp.load(state, storage_reader=reader())
        module.load_state_dict(state[self._shm_model_key], strict=strict)
        for i, optimizer in enumerate(self.optimizers):  # type: ignore[attr-defined]
            key = f"optimizer_{i}"
            optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp.load(optimizer_state, storage_reader=reader())
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=optimizer_state[key],
                options=StateDictOptions(cpu_offload=True),
            )  # fmt: skip
        return state[PICKLED]


class _FSDPSharded(_ShmStageSharded):
    """``FSDPStrategy(state_dict_type="sharded")`` (FSDP1): sharded state dicts."""

    def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)

    def _shm_sharded(self) -> bool:
        return self._state_dict_type == "sharded"  # type: ignore[attr-defined]

    def _shm_load_states(self, reader: Callable[[], Any]) -> bytes:
        """What ``FSDPStrategy.load_checkpoint`` does for a sharded checkpoint, with our
        reader."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        module = self.model  # type: ignore[attr-defined]
        lightning_fsdp = importlib.import_module(self._shm_base_module)  # type: ignore[attr-defined]
        with lightning_fsdp._get_sharded_state_dict_context(module):
            state: dict[str, Any] = {"model": module.state_dict(), PICKLED: b""}
            dcp.load(state, storage_reader=reader())
            module.load_state_dict(
                state["model"], strict=self.lightning_module.strict_loading  # type: ignore[attr-defined]
            )
            trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
            if trainer.state.fn == "fit" and self.optimizers:  # type: ignore[attr-defined]
                for i, optimizer in enumerate(self.optimizers):  # type: ignore[attr-defined]
                    key = f"optimizer_{i}"
                    loaded = load_sharded_optimizer_state_dict(
                        model_state_dict=state["model"], optimizer_key=key, storage_reader=reader()
                    )
                    optimizer.load_state_dict(
                        FSDP.optim_state_dict_to_load(
                            optim_state_dict=loaded[key], model=module, optim=optimizer
                        )
                    )
        return state[PICKLED]


def _strategy_class(name: str, base_name: str, mixin: type) -> type:
    """``name``: ``mixin`` over the Lightning strategy ``base_name`` (of ``lightning`` when
    installed, else of ``pytorch_lightning``)."""
    if name not in _built:
        for namespace in ("lightning.pytorch.strategies", "pytorch_lightning.strategies"):
            try:
                base = getattr(importlib.import_module(namespace), base_name)
                break
            except ImportError:
                continue
        else:
            raise _missing(name)
        _built[name] = type(
            name,
            (mixin, base),
            {"__module__": __name__, "__doc__": mixin.__doc__, "_shm_base_module": base.__module__},
        )
    return _built[name]


_STRATEGIES: Final = {
    "ShmStageFSDPStrategy": ("FSDPStrategy", _FSDPSharded),
    "ShmStageModelParallelStrategy": ("ModelParallelStrategy", _ModelParallelSharded),
}


def __getattr__(name: str) -> Any:
    if name == "ShmStageCheckpointIO":
        return _checkpoint_io_class()
    if name in _STRATEGIES:
        return _strategy_class(name, *_STRATEGIES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

