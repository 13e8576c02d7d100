"""Stand-in: custom-op registration with torch.library, as vLLM does it."""
import torch
from torch.library import Library, infer_schema

vllm_lib = Library("vllm", "FRAGMENT")
LayerNameType = str


def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None,
                              target_lib=None, dispatch_key=None, tags=()):
    if mutates_args is None:
        mutates_args = []
    if dispatch_key is None:
        from vllm.platforms import current_platform
        dispatch_key = current_platform.dispatch_key
    schema_str = infer_schema(op_func, mutates_args=mutates_args)
    my_lib = target_lib or vllm_lib
    my_lib.define(op_name + schema_str, tags=tags)
    my_lib.impl(op_name, op_func, dispatch_key=dispatch_key)
    if fake_impl is not None:
        my_lib._register_fake(op_name, fake_impl)


def _resolve_layer_name(name):
    return name
