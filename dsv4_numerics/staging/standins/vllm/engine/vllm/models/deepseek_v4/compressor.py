"""Stand-in: the DSv4 compressor model layer (base of the ROCm MXFP4 compressor layer)."""
from vllm._staged_engine import engine_only

CompressorMetadata, DeepseekCompressor = engine_only(__name__, 'CompressorMetadata', 'DeepseekCompressor')
