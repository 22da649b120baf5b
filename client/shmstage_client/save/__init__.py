"""The save wing: a state dict staged into shmstaged and committed to be written.

Read top-down from ``stager``, whose docstring maps the steps of a save to the modules
that do them: ``destination`` (where it goes), ``layouts`` (the registered layout and its
slots), ``slots`` (the slots mapped here and the copy into them), ``staged`` (the commit),
``handle`` (what a save reports); for a non-blocking save, ``guard``, ``deferred_copy`` and
``handover``. Nothing here imports the restore wing (``shmstage_client.restore``).
"""
