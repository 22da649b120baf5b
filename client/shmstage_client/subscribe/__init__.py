"""The subscribe wing: a channel's newest published weights, read by another process.

Read top-down from ``subscriber`` (``subscribe``, ``Subscriber.wait``): ``version`` is one
pinned version and what it copies to a device (whole, or streamed in buckets); ``ring``
holds the publisher's slots, mapped read-only once each and kept across versions;
``sharded`` reads a sharded publisher's version (one part per rank) as full tensors or as
one rank's shards. It may
use the restore wing (``shmstage_client.restore``), never the save wing, and nothing
imports it but the package's top.
"""
