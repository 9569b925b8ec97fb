"""What the plugin expects of vLLM, in one table, checked against vLLM's source with `ast`.

Every method the plugin patches or calls (with its parameters), every attribute it reads on vLLM's
objects, and the names vLLM's own code must read for a patch to hold (the scheduler's split reads
`shared_prefix_boundary`, which the plugin sets around it). The same table and checker serve

- the runtime guard (`install()`): the installed vLLM's source, read from its package folder;
- CI's check of a release that cannot be imported here (vLLM's CUDA wheel on a CPU machine):
  `python -m ssm_serving.vllm_plugin.compat DIR`, DIR holding the wheel's unzipped `vllm/` tree.

An attribute counts as present where vLLM's class (or a base class it inherits from, followed
through imports inside vLLM) declares it: a dataclass field or class attribute, a method or
property, or an assignment to `self.<name>` in any of its methods.
"""
from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ssm_kernels.cache_ops import NULL_BLOCK_ID, PAD_SLOT_ID

# vLLM releases this plugin was written and checked against (CI runs 0.32's CPU build under both
# of its model runners and reads the source of 0.33 and 0.34, whose CUDA wheels do not run here).
SUPPORTED_VERSIONS = ("0.32.", "0.33.", "0.34.")


_ANY = object()  # Expect.value unchecked


@dataclass(frozen=True)
class Expect:
    """One thing the plugin needs: `name` (a class, function or constant) in `module`; for a
    class, its method `method` with parameters `params` (in order; `*args`, `**kwargs` spelled
    so; `other_params`: other releases' parameters, also accepted), the instance attributes
    `attrs` the plugin reads, the names `uses` vLLM's method must read; for a constant, the
    literal `value` it must be assigned; `optional`: a hook newer releases add, checked where
    present."""
    module: str
    name: str
    method: str | None = None
    params: tuple[str, ...] | None = None
    other_params: tuple[tuple[str, ...], ...] = ()
    attrs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    optional: bool = False
    value: object = _ANY


_MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"
_MIXER1 = "vllm.model_executor.layers.mamba.mamba_mixer"
_CKPT = "vllm.model_executor.layers.mamba.checkpoint"
_B1 = "vllm.v1.attention.backends.mamba1_attn"
_B2 = "vllm.v1.attention.backends.mamba2_attn"
_MGR = "vllm.v1.core.single_type_kv_cache_manager"
_SCHED = "vllm.v1.core.sched.scheduler"
_KVM = "vllm.v1.core.kv_cache_manager"
_BUILD = ("self", "common_prefix_len", "common_attn_metadata", "fast_build", "**kwargs")
_UPDATE = ("self", "metadata", "blk_table", "slot_mapping")
_MD = ("num_prefills", "num_decodes", "num_prefill_tokens", "num_decode_tokens", "query_start_loc_p",
       "state_indices_tensor_p", "state_indices_tensor_d", "has_initial_states_p")

EXPECTED: tuple[Expect, ...] = (
    # Patched: the layers' forward, the Mamba-1 kv-cache spec and (0.33) checkpoint alignment.
    Expect(_MIXER2, "MambaMixer2", "conv_ssm_forward", ("self", "projected_states", "output"),
           attrs=("prefix", "use_replayssm", "num_spec", "tped_intermediate_size", "tped_conv_size", "tped_dt_size",
                  "kv_cache", "num_heads", "tp_size", "n_groups", "head_dim", "split_hidden_states_B_C_fn",
                  "conv_weights", "conv1d", "activation", "A", "D", "dt_bias")),
    Expect(_MIXER1, "MambaMixer", "forward_impl", ("self", "hidden_states", "output"),
           attrs=("prefix", "is_lora_enabled", "kv_cache", "in_proj", "conv1d", "activation", "A", "D", "out_proj")),
    Expect(_MIXER1, "MambaMixer", "_time_proj_bias", ("self",)),
    # 0.34 added the rows' place in the batch, which only its LoRA path reads (mixers.py).
    Expect(_MIXER1, "MambaMixer", "_ssm_transform", ("self", "x", "batch_start", "num_batch_tokens"),
           other_params=(("self", "x"),)),
    Expect(_MIXER1, "MambaMixer", "get_kv_cache_spec", ("self", "vllm_config")),
    Expect(_MIXER2, "MambaMixer2", "get_kv_cache_spec", ("self", "vllm_config")),
    Expect(_MIXER1, "MambaMixer", "get_prefill_checkpoint_alignment", ("self",), optional=True),  # 0.33
    # Patched: the scheduler side (which block ends get a block, admission, retention).
    Expect(_MGR, "MambaManager", "get_num_blocks_to_allocate",
           ("self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
            "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "prefill_end"),
           attrs=("kv_cache_spec", "block_pool", "block_size", "req_to_blocks", "_checkpoints")),
    Expect(_MGR, "MambaManager", "allocate_new_blocks", ("self", "request_id", "num_tokens", "num_tokens_main_model")),
    Expect(_MGR, "MambaManager", "pop_blocks_for_free", ("self", "request_id")),
    Expect(_MGR, "MambaManager", "reachable_block_mask",
           ("cls", "start_block", "end_block", "alignment_tokens", "kv_cache_spec", "use_eagle", "retention_interval",
            "reachable_boundaries", "dcp_world_size", "final_segment_end_block")),
    Expect(_SCHED, "Scheduler", "_mamba_block_aligned_split",
           ("self", "request", "num_new_tokens", "num_new_local_computed_tokens", "num_external_computed_tokens"),
           attrs=("kv_cache_manager", "mamba_shared_prefix_checkpoint"), uses=("shared_prefix_boundary",)),
    Expect(_KVM, "KVCacheManager", "allocate_slots",
           ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
            "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens",
            "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs", "skip_zeroing_group_ids"),
           attrs=("coordinator",)),
    # Patched: the worker side (the step's captures, from the block table).
    Expect(_B2, "Mamba2AttentionMetadataBuilder", "build", _BUILD, attrs=("kv_cache_spec", "vllm_config")),
    Expect(_B2, "Mamba2AttentionMetadataBuilder", "update_block_table", _UPDATE),
    Expect(_B1, "Mamba1AttentionMetadataBuilder", "build", _BUILD, attrs=("kv_cache_spec", "vllm_config")),
    Expect(_B1, "Mamba1AttentionMetadataBuilder", "update_block_table", _UPDATE),
    # Read: metadata, specs, the block pool, requests, configs.
    Expect(_B2, "Mamba2AttentionMetadata", attrs=_MD + ("checkpoint_meta", "chunk_size")),
    Expect(_B1, "Mamba1AttentionMetadata", attrs=_MD),
    Expect("vllm.v1.attention.backend", "CommonAttentionMetadata",
           attrs=("num_reqs", "seq_lens_cpu_upper_bound", "query_start_loc_cpu", "block_table_tensor")),
    Expect("vllm.v1.kv_cache_interface", "MambaSpec",
           attrs=("mamba_type", "mamba_cache_mode", "num_speculative_blocks", "block_size",
                  "num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment")),
    Expect("vllm.v1.core.block_pool", "BlockPool", attrs=("hash_block_size", "num_gpu_blocks", "get_new_blocks")),
    Expect("vllm.v1.core.kv_cache_utils", "KVCacheBlock", attrs=("is_null",)),
    Expect("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", attrs=("single_type_managers",)),
    Expect("vllm.v1.request", "Request", attrs=("request_id", "shared_prefix_boundary")),
    Expect("vllm.config.cache", "CacheConfig", attrs=("hash_block_size", "enable_prefix_caching")),
    Expect("vllm.v1.attention.backends.registry", "MambaAttentionBackendEnum", attrs=("MAMBA1", "MAMBA2")),
    Expect(_CKPT, "MambaPrefillCheckpointBuilder", "__init__", ("self", "vllm_config", "kv_cache_spec")),
    Expect(_CKPT, "MambaPrefillCheckpointBuilder", "build", ("self", "m", "request_rows")),
    Expect(_CKPT, "MambaPrefillCheckpointMetadata", attrs=("offsets",)),
    Expect("vllm.utils.torch_utils", "async_tensor_h2d", params=("data", "device", "dtype", "out")),
    Expect("vllm.model_executor.layers.mamba.mamba_utils", "is_conv_state_dim_first", params=()),
    Expect("vllm.forward_context", "get_forward_context", params=()),
    Expect("vllm.forward_context", "ForwardContext", attrs=("attn_metadata",)),
    # The slot ids of padded rows (cache_ops.PAD_SLOT_ID, NULL_BLOCK_ID), which the kernels skip.
    Expect("vllm.v1.attention.backends.utils", "PAD_SLOT_ID", value=PAD_SLOT_ID),
    Expect("vllm.v1.attention.backends.utils", "NULL_BLOCK_ID", value=NULL_BLOCK_ID),
)


# ---------------------------------------------------------------------------------------------
# The checker
# ---------------------------------------------------------------------------------------------
class SourceTree:
    """vLLM's modules parsed on demand from `read(module) -> source text or None`."""

    def __init__(self, read: Callable[[str], str | None]):
        self._read, self._trees = read, {}

    @classmethod
    def at(cls, root: Path) -> SourceTree:
        """The tree under `root` (the folder that holds `vllm/`)."""
        def read(module: str) -> str | None:
            base = Path(root, *module.split("."))
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path.read_text(encoding="utf-8")
            return None
        return cls(read)

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            text = self._read(name)
            self._trees[name] = ast.parse(text) if text is not None else None
        return self._trees[name]

    def top_level(self, module: str, name: str, seen=()) -> tuple[str, ast.AST] | None:
        """The definition of `name` in `module` (a class, function or assignment), following
        `from vllm... import name` re-exports."""
        tree = self.module(module)
        if tree is None or (module, name) in seen:
            return None
        for node in _top_statements(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if name in _assigned(node):
                return module, node
        source = _imported(tree, module).get(name)
        return self.top_level(*source, seen + ((module, name),)) if source else None

    def classes(self, module: str, name: str) -> list[ast.ClassDef]:
        """The class and the vLLM classes it inherits from, nearest first."""
        found, todo, out = set(), [(module, name)], []
        while todo:
            where = self.top_level(*todo.pop(0))
            if where is None or not isinstance(where[1], ast.ClassDef) or id(where[1]) in found:
                continue
            mod, node = where
            found.add(id(node))
            out.append(node)
            for base in node.bases:
                base = base.value if isinstance(base, ast.Subscript) else base  # Generic[M], Base[M]
                if isinstance(base, ast.Name):
                    todo.append((mod, base.id))
        return out

    def check(self, expect: Expect) -> str | None:
        """None when vLLM has what `expect` describes, else what differs."""
        label = f"{expect.module}.{expect.name}" + (f".{expect.method}" if expect.method else "")
        found = self.top_level(expect.module, expect.name)
        if found is None:
            return f"{label}: {expect.name} is not defined in {expect.module}"
        node = found[1]
        if isinstance(node, ast.ClassDef):
            classes = self.classes(expect.module, expect.name)
            if expect.method:
                fn = next((item for c in classes for item in c.body if isinstance(item, _FUNCS)
                           and item.name == expect.method), None)
                if fn is None:
                    return None if expect.optional else f"{label}: no such method"
                node = fn
            missing = [a for a in expect.attrs if a not in _class_attributes(classes)]
            if missing:
                return f"{label}: {expect.name} no longer has {', '.join(missing)}"
        if expect.params is not None:
            if not isinstance(node, _FUNCS):
                return f"{label}: not a function"
            params = _params(node.args)
            if params != expect.params and params not in expect.other_params:
                return f"{label}: parameters ({', '.join(params)}), expected ({', '.join(expect.params)})"
        missing = [u for u in expect.uses if u not in _names(node)]
        if missing:
            return f"{label}: no longer reads {', '.join(missing)}"
        if expect.value is not _ANY:
            try:
                value = ast.literal_eval(node.value) if isinstance(node, (ast.Assign, ast.AnnAssign)) else _ANY
            except ValueError:
                value = _ANY
            if value is _ANY or value != expect.value:
                return f"{label}: no longer the literal {expect.value!r}"
        return None

    def version(self) -> str | None:
        """vllm.__version__ as the tree's `vllm/_version.py` sets it."""
        tree = self.module("vllm._version")
        for node in tree.body if tree else ():
            if isinstance(node, ast.Assign) and "__version__" in _assigned(node) and \
                    isinstance(node.value, ast.Constant):
                return node.value.value
        return None


_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _top_statements(body):
    """A module's statements, those under a top-level `if` (`if TYPE_CHECKING:`) included."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_statements(node.body + node.orelse)


def _assigned(node) -> set[str]:
    """Names a module- or class-level statement binds (assignments and annotations)."""
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _imported(tree: ast.Module, module: str) -> dict[str, tuple[str, str]]:
    """name -> (vLLM module, name there) for the module's top-level `from ... import` lines."""
    out = {}
    package = module.split(".")
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the module's package
                source = ".".join(package[:len(package) - node.level] + ([source] if source else []))
            if source.split(".")[0] == "vllm":
                for alias in node.names:
                    out[alias.asname or alias.name] = (source, alias.name)
    return out


def _class_attributes(classes: list[ast.ClassDef]) -> set[str]:
    names = set()
    for cls in classes:
        for item in cls.body:
            names |= _assigned(item)
            if isinstance(item, _FUNCS):
                names.add(item.name)
                for n in ast.walk(item):
                    targets = n.targets if isinstance(n, ast.Assign) else \
                        [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
                    for t in targets:
                        for a in ast.walk(t):
                            if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self":
                                names.add(a.attr)
                    # torch's self.register_buffer("name", ...) / register_parameter
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                            n.func.attr in ("register_buffer", "register_parameter") and n.args and \
                            isinstance(n.args[0], ast.Constant):
                        names.add(n.args[0].value)
    return names


def _params(args: ast.arguments) -> tuple[str, ...]:
    out = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        out.append("*" + args.vararg.arg)
    out += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        out.append("**" + args.kwarg.arg)
    return tuple(out)


def _names(node) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}


def problems(tree: SourceTree, version: str | None) -> list[str]:
    """Everything in EXPECTED the tree lacks, and the version when it is not a supported one."""
    out = [] if version and version.startswith(SUPPORTED_VERSIONS) else [
        f"vLLM {version} is not a version this plugin was written for ({', '.join(SUPPORTED_VERSIONS)}x)"]
    return out + [p for p in map(tree.check, EXPECTED) if p]


def installed_problems() -> list[str]:
    """problems() of the vLLM this process imports."""
    import vllm

    return problems(SourceTree.at(Path(vllm.__file__).resolve().parent.parent), getattr(vllm, "__version__", None))


def main(argv=None) -> int:
    """CI: check the vLLM source tree under DIR (an unzipped wheel) against EXPECTED."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ssm_serving.vllm_plugin.compat", description=main.__doc__)
    parser.add_argument("root", type=Path, help="the folder holding vllm/ (e.g. an unzipped wheel)")
    args = parser.parse_args(argv)
    if not (args.root / "vllm" / "__init__.py").is_file():
        parser.error(f"{args.root} holds no vllm/__init__.py")
    tree = SourceTree.at(args.root)
    version = tree.version()
    found = problems(tree, version)
    for p in found:
        print(f"MISMATCH {p}")
    print(f"vLLM {version}: {len(EXPECTED)} expectations, {len(found)} mismatches")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
