"""Stand-in: the DSv4 sparse-MLA backend and metadata (bases of the ROCm backend classes)."""
from vllm._staged_engine import engine_only

DeepseekV4FlashMLAMetadata, DeepseekV4SparseMLABackend, DeepseekV4SparseMLAMetadataBuilder = engine_only(__name__, 'DeepseekV4FlashMLAMetadata', 'DeepseekV4SparseMLABackend', 'DeepseekV4SparseMLAMetadataBuilder')
