"""vLLM plugin: vLLM's Mamba layers on ssm_kernels, with in-pass state captures.

Registered under the entry-point group `vllm.general_plugins` (see pyproject.toml), so vLLM
loads it in every process once this package is installed next to vLLM; `VLLM_PLUGINS` filters
plugins as usual, and `SSM_KERNELS_VLLM=0` turns this one off (settings.py has every setting,
checked at engine start). What it changes:

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
  "auto" (default: chunked on CUDA where the step's longest sequence has the chunked scan's
  AUTO_CHUNKED_MIN_TOKENS, recurrent elsewhere and on CPU), "chunked" or "recurrent". Captures
  stay in-pass with either.

It checks vLLM's version (0.32.x to 0.34.x) and, in vLLM's source, every method it patches or
calls and every attribute it reads (compat.py's table, which CI also checks against the source of
the releases it cannot run); where anything differs it leaves vLLM as it is and logs one warning.
It runs under both of vLLM's model runners, V1 and Model Runner V2 (vLLM's default on CUDA, its
only runner from 0.34): both copy a request's running state into the block its step ends in before
the forward, and the Mamba layers' metadata, which the plugin extends, is built the same way.
"""
from __future__ import annotations

import logging

from . import settings

# Under vLLM's logger tree, so its handlers and level apply.
logger = logging.getLogger("vllm.plugins.ssm_prefill_kernels")
_state = {"installed": False, "reason": None}


def check_compatible() -> str | None:
    """None when this vLLM is one the plugin knows, else why not: its version (0.32.x to 0.34.x)
    and everything compat.EXPECTED lists (the methods patched, the attributes read), from the
    installed vLLM's source."""
    from . import compat

    found = compat.installed_problems()
    return "; ".join(found) if found else None


def check_engine(vllm_config, spec, vllm_forward: str | None = None) -> None:
    """At engine start (each Mamba layer's kv-cache spec, in every worker): what only the
    configuration tells. The capture interval against the Mamba block size; refused: prefix hits
    inside a block (prefix_match_unit), and, while captures are on, a layer that runs vLLM's own
    forward (`vllm_forward` says why: ReplaySSM, LoRA on a Mamba-1 layer), which would leave the
    block-end states the scheduler keeps for its group unwritten."""
    if getattr(spec, "mamba_cache_mode", None) == "align":
        settings.check_block_size(settings.current, spec.block_size)
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching and vllm_forward and settings.current.interval(spec.block_size):
            raise ValueError(
                f"ssm-prefill-kernels: with {vllm_forward} a Mamba layer runs vLLM's own forward, which writes none of "
                f"the block-end states the plugin keeps; set {settings.INTERVAL}=0 (vLLM's own capture policy) or "
                f"{settings.ENABLE}=0")
        unit = getattr(cache, "prefix_match_unit", None)
        if cache.enable_prefix_caching and unit not in (None, spec.block_size):
            raise ValueError(
                f"ssm-prefill-kernels: prefix_match_unit={unit} below the Mamba block size {spec.block_size} (vLLM's "
                "prefix hits inside a block) is not supported: on vLLM's CPU build a warm request resuming inside a "
                "block gave other tokens than a cold one, though the Mamba states it resumed from were exact; unset "
                f"prefix_match_unit, or set {settings.ENABLE}=0 to serve with vLLM's own Mamba kernels")


def install() -> bool:
    """Patch vLLM (idempotent). Returns whether the plugin is active; ValueError for a bad
    setting (settings.py), before anything is patched."""
    if _state["installed"]:
        return True
    try:
        settings.current = settings.read()
    except ValueError as error:
        _state["reason"] = str(error)
        raise
    if not settings.current.enabled:
        _state["reason"] = f"{settings.ENABLE}=0"
        return False
    try:
        reason = check_compatible()
    except Exception as e:  # an import path that moved is a mismatch too
        reason = f"vLLM's Mamba code is not where this plugin expects it ({type(e).__name__}: {e})"
    if reason is not None:
        _state["reason"] = reason
        logger.warning("ssm-prefill-kernels: leaving vLLM's own Mamba kernels in place: %s", reason)
        return False

    from dataclasses import replace

    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionMetadataBuilder
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
    from vllm.v1.core.kv_cache_manager import KVCacheManager
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
    spec1_of, spec2_of = MambaMixer.get_kv_cache_spec, MambaMixer2.get_kv_cache_spec

    def mamba1_kv_cache_spec(self, vllm_config):
        spec = spec1_of(self, vllm_config)
        reason = mixers.mamba1_vllm_forward(self)
        check_engine(vllm_config, spec, reason)
        if isinstance(spec, MambaSpec) and reason is None:
            spec = replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
        return spec

    def mamba2_kv_cache_spec(self, vllm_config):
        spec = spec2_of(self, vllm_config)
        check_engine(vllm_config, spec, mixers.mamba2_vllm_forward(self))
        return spec

    MambaMixer.get_kv_cache_spec = mamba1_kv_cache_spec
    MambaMixer2.get_kv_cache_spec = mamba2_kv_cache_spec
    if hasattr(MambaMixer, "get_prefill_checkpoint_alignment"):
        # vLLM 0.33's hook (MambaBase: None, no in-pass checkpoint): the plugin's Mamba-1 layer
        # exports a checkpoint at any token, as its spec says.
        MambaMixer.get_prefill_checkpoint_alignment = lambda self: None if mixers.mamba1_vllm_forward(self) else 1
    captures.patch_manager(MambaManager)
    captures.patch_kv_cache_manager(KVCacheManager)
    captures.patch_scheduler(Scheduler)
    captures.patch_builder(Mamba2AttentionMetadataBuilder)
    captures.patch_builder(Mamba1AttentionMetadataBuilder)
    _state.update(installed=True, prefill_algorithm=settings.current.prefill_algorithm,
                  capture_interval=settings.current.capture_interval)
    logger.info("ssm-prefill-kernels: vLLM's Mamba-1/Mamba-2 layers run on ssm_kernels, block-end "
                "states captured in-pass")
    return True


def register() -> None:
    """The `vllm.general_plugins` entry point."""
    install()


def status() -> dict:
    """Whether the plugin is active, and why not if it is not."""
    return dict(_state)
