"""Stand-in: tensor parallelism is engine machinery (used by ROCm model layers only)."""
from vllm._staged_engine import engine_only

get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce = engine_only(__name__, 'get_tensor_model_parallel_world_size', 'tensor_model_parallel_all_reduce')
