"""vLLM plugin: vLLM's Mamba layers on ssm_kernels, with in-pass state captures.

Registered under the entry-point group `vllm.general_plugins` (see pyproject.toml), so vLLM
loads it in every process once this package is installed next to vLLM; `VLLM_PLUGINS` filters
plugins as usual, and `SSM_KERNELS_VLLM=0` turns this one off. What it changes:

- `MambaMixer2.conv_ssm_forward` (Mamba-2 layers: Granite-4.0-H, Nemotron-H, Falcon-H1, Zamba2,
  Mamba-2) and `MambaMixer.forward_impl` (Mamba-1: Jamba, Mamba) run the conv, the scan and the
  decode step on ssm_kernels.cache_ops, writing states in place into vLLM's cache blocks. On vLLM's
  CPU build this makes prefix caching work for Mamba-2 (its own CPU scan cannot write the
  checkpoint) and Mamba-1 models run at all (the CPU build has no Mamba-1 scan).
- In prefix-caching ("align") mode, every block end a prefill pass crosses is captured in that
  pass into its own cache block, which the prefix cache keeps (captures.py has the policy); vLLM
  keeps only the prompt's tail. Mamba-1 layers get vLLM's in-pass tail checkpoint too, and no
  pass is cut at a shared-prefix junction any more (its state is captured in-pass instead).
- Prefill scans run the algorithm `SSM_KERNELS_VLLM_PREFILL_ALGORITHM` names (mixers.py):
  "auto" (default: chunked on CUDA, recurrent on CPU), "chunked" or "recurrent". Captures stay
  in-pass with either.

It checks vLLM's version and the signatures it patches; where they differ from what it was
written against it leaves vLLM as it is and logs one warning.
"""
from __future__ import annotations

import inspect
import logging
import os

# vLLM releases whose Mamba code this plugin was written and tested against.
SUPPORTED_VERSIONS = ("0.32.",)
ENV_ENABLE = "SSM_KERNELS_VLLM"

# Under vLLM's logger tree, so its handlers and level apply.
logger = logging.getLogger("vllm.plugins.ssm_prefill_kernels")
_state = {"installed": False, "reason": None}


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _fields(cls) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {}))


def check_compatible() -> str | None:
    """None when this vLLM is one the plugin knows, else why not."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VERSIONS):
        return f"vLLM {version} is not a version this plugin was written for ({', '.join(SUPPORTED_VERSIONS)}x)"
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionMetadataBuilder
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadata, Mamba2AttentionMetadataBuilder
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    expected = [
        (MambaMixer2.conv_ssm_forward, ["self", "projected_states", "output"]),
        (MambaMixer.forward_impl, ["self", "hidden_states", "output"]),
        (MambaManager.allocate_new_blocks, ["self", "request_id", "num_tokens", "num_tokens_main_model"]),
        (MambaManager.get_num_blocks_to_allocate,
         ["self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
          "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "prefill_end"]),
        (Mamba2AttentionMetadataBuilder.update_block_table, ["self", "metadata", "blk_table", "slot_mapping"]),
        (Scheduler._mamba_block_aligned_split, ["self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                                                "num_external_computed_tokens"]),
        (Mamba2AttentionMetadataBuilder.build, ["self", "common_prefix_len", "common_attn_metadata", "fast_build",
                                                "kwargs"]),
        (Mamba1AttentionMetadataBuilder.update_block_table, ["self", "metadata", "blk_table", "slot_mapping"]),
        (MambaManager.pop_blocks_for_free, ["self", "request_id"]),
        (MambaManager.reachable_block_mask, ["start_block", "end_block", "alignment_tokens", "kv_cache_spec",
                                             "use_eagle", "retention_interval", "reachable_boundaries",
                                             "dcp_world_size", "final_segment_end_block"]),
        (MambaMixer.get_kv_cache_spec, ["self", "vllm_config"]),
        (Mamba1AttentionMetadataBuilder.build, ["self", "common_prefix_len", "common_attn_metadata",
                                                "fast_build", "kwargs"]),
    ]
    for fn, params in expected:
        if _params(fn) != params:
            return f"{fn.__qualname__}{inspect.signature(fn)} is not the signature this plugin patches"
    needed = {"num_prefills", "num_decodes", "num_prefill_tokens", "num_decode_tokens", "query_start_loc_p",
              "state_indices_tensor_p", "state_indices_tensor_d", "has_initial_states_p", "checkpoint_meta"}
    missing = needed - _fields(Mamba2AttentionMetadata)
    if missing:
        return f"Mamba2AttentionMetadata lacks {sorted(missing)}"
    for name in ("split_hidden_states_B_C_fn", "tped_intermediate_size", "tped_conv_size", "tped_dt_size"):
        if name not in inspect.getsource(MambaMixer2.__init__):
            return f"MambaMixer2 no longer sets {name}"
    manager_source = inspect.getsource(MambaManager)
    for name in ("self._checkpoints", "self.req_to_blocks", "is_null"):
        if name not in manager_source:
            return f"MambaManager no longer uses {name}"
    if "shared_prefix_boundary" not in inspect.getsource(Scheduler._mamba_block_aligned_split):
        return "the scheduler's block-aligned split no longer reads request.shared_prefix_boundary"
    return None


def install() -> bool:
    """Patch vLLM (idempotent). Returns whether the plugin is active."""
    if _state["installed"]:
        return True
    if os.environ.get(ENV_ENABLE, "1").strip() in ("0", "false", "no"):
        _state["reason"] = f"{ENV_ENABLE}=0"
        return False
    try:
        reason = check_compatible()
    except Exception as e:  # an import path that moved is a mismatch too
        reason = f"vLLM's Mamba code is not where this plugin expects it ({type(e).__name__}: {e})"
    if reason is None:
        from . import mixers

        try:
            _state["prefill_algorithm"] = mixers.prefill_algorithm()
        except ValueError as e:
            reason = str(e)
    if reason is not None:
        _state["reason"] = reason
        logger.warning("ssm-prefill-kernels: leaving vLLM's own Mamba kernels in place: %s", reason)
        return False

    from dataclasses import replace

    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionMetadataBuilder
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import MambaSpec

    from . import captures, mixers

    mixers.ORIGINAL["mamba2"] = MambaMixer2.conv_ssm_forward
    mixers.ORIGINAL["mamba1"] = MambaMixer.forward_impl
    MambaMixer2.conv_ssm_forward = mixers.mamba2_conv_ssm_forward
    MambaMixer.forward_impl = mixers.mamba1_forward_impl

    # Mamba-1 layers export vLLM's prompt-tail checkpoint in-pass, as its Mamba-2 layer does, so
    # the scheduler no longer cuts a pass there.
    spec_of = MambaMixer.get_kv_cache_spec

    def mamba1_kv_cache_spec(self, vllm_config):
        spec = spec_of(self, vllm_config)
        if isinstance(spec, MambaSpec) and not self.is_lora_enabled:
            spec = replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
        return spec

    MambaMixer.get_kv_cache_spec = mamba1_kv_cache_spec
    captures.patch_manager(MambaManager)
    captures.patch_scheduler(Scheduler)
    captures.patch_builder(Mamba2AttentionMetadataBuilder)
    captures.patch_builder(Mamba1AttentionMetadataBuilder)
    _state["installed"] = True
    logger.info("ssm-prefill-kernels: vLLM's Mamba-1/Mamba-2 layers run on ssm_kernels, block-end "
                "states captured in-pass")
    return True


def register() -> None:
    """The `vllm.general_plugins` entry point."""
    install()


def status() -> dict:
    """Whether the plugin is active, and why not if it is not."""
    return dict(_state)
