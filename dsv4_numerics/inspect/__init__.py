"""Reading KV-cache dumps: the per-slot table of a 584-byte MODEL1 cache (``cache``) and which
paged layout and byte order a dump was written in (``layout``)."""
