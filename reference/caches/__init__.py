"""dsv4_numerics.reference.caches: Paged KV-cache layouts: the 584-byte MODEL1 record, V3.2, plain rows and the V4.1 MXFP8/NVFP4 records."""
