"""Stand-in: the model weight loader (fused_layout.permute_on_load names it at load time only)."""
from vllm._staged_engine import engine_only

composed_weight_loader, = engine_only(__name__, 'composed_weight_loader')
