"""The restore wing: a checkpoint back on a device, from the daemon's memory or its files.

Read top-down from ``restoring`` (``latest``, ``restore``, ``load``, ``prepare_restore``):
``lease`` holds a checkpoint in the daemon's memory, ``files`` opens one on disk,
``sources`` reads the bytes of either, ``transfer`` moves them to the device verified,
through the pinned staging of ``host_staging``, checked on the device by ``device_checks``
where asked to. ``adoption`` is a restart's restore made ahead (``prepare_restore``): the
caller's retained layout adopted, pinned and checked while the model is built, read
straight to the device, then offered to the save wing through ``shmstage_client.handoff``.
Nothing here imports the save wing (``shmstage_client.save``).

``shmstage_client.restore`` the attribute is the ``restore()`` function, which shadows this
package's name there: import its modules by their full path (``from
shmstage_client.restore import transfer``).
"""
