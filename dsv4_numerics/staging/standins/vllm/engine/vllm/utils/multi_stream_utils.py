"""Stand-in: multi-stream execution of model layers."""
from vllm._staged_engine import engine_only

execute_in_parallel, = engine_only(__name__, 'execute_in_parallel')
