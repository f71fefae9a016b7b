"""Find SGLang, detect its release and classes, and the CPU stand-ins its import chain needs.

SGLang's radix caches are pure Python over torch tensors and run on CPU, but their import
chain reaches modules that only a GPU install has. The stand-ins here are installed only when
the real module is missing, and only for the modules named below, so that kvcheck runs in a
side venv built by scripts/install-sglang.sh as in a user's own SGLang environment, untouched.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from typing import Any

INSTALL_HINT = ("SGLang is not importable here; build a side venv with "
                "`scripts/install-sglang.sh VERSION DIR` and run kvcheck with DIR/bin/python")

# sglang modules whose only use of torchvision is image preprocessing for vision models; with
# no CPU torchvision they are replaced by KVCHECK_CPU_STUB modules (config classes still exist).
TORCHVISION_USERS = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr")
# CUDA-only kernel packages that releases before 0.5.7 import at module level (0.4.10-0.5.6:
# `from sgl_kernel import ...` in sglang.srt.utils / layers; the caches call none of it).
CUDA_ONLY = ("sgl_kernel",)


# The releases the adapter is tested on (.ci/run builds both). Before 0.4.10 the chain needs
# APIs torch 2.13 / triton 3.8 dropped (0.4.8-0.4.9), and before 0.4.8 there is no allocator module.
OLDEST, NEWEST = "0.4.10", "0.5.23"


class SglangUnavailable(RuntimeError):
    """SGLang (or the class a layout needs) cannot be used here; the message is one line."""


class LayoutError(ValueError):
    """A layout that is unknown, malformed or not supported by the installed release."""


class _Anything:
    """KVCHECK_CPU_STUB: stands for a GPU-only object; any use returns another stand-in."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __call__(self, *a: Any, **k: Any) -> "_Anything":
        return _Anything()

    def __getattr__(self, n: str) -> "_Anything":
        if n.startswith("__"):
            raise AttributeError(n)
        return _Anything()


class _StubModule(types.ModuleType):
    """KVCHECK_CPU_STUB module: `...Config` names are empty PretrainedConfig subclasses (they
    are registered with transformers' AutoConfig), anything else is a stand-in."""

    __path__: list[str] = []

    def __getattr__(self, n: str) -> Any:
        if n.startswith("__"):
            raise AttributeError(n)
        if n.endswith("Config"):
            from transformers import PretrainedConfig
            c = type(n, (PretrainedConfig,), {"model_type": "kvcheck_stub_" + n.lower()})
            setattr(self, n, c)
            return c
        return _Anything()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves KVCHECK_CPU_STUB modules for exactly `exact` and packages under `roots`."""

    def __init__(self, exact: tuple[str, ...], roots: tuple[str, ...]) -> None:
        self.exact, self.roots = exact, roots

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in self.exact or name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.KVCHECK_CPU_STUB = True   # type: ignore[attr-defined]
        used = module.__name__ if module.__name__ in self.exact else module.__name__.split(".")[0]
        if used not in STUBBED:          # what the import chain actually reached
            STUBBED.append(used)
        if module.__name__ == "torchvision":
            module.__version__ = "0.0.0+kvcheck.cpu.stub"   # type: ignore[attr-defined]


STUBBED: list[str] = []     # what was stubbed in this process (reported by --list-layouts)


def _missing(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is None
    except (ImportError, ValueError):
        return True


def _imports_torchvision(rel: str) -> bool:
    """Whether sglang's file `rel` imports torchvision at its top level (read, not imported:
    finding a submodule's spec would import its parents)."""
    try:
        spec = importlib.util.find_spec("sglang")
        root = list(spec.submodule_search_locations or [])[0] if spec else ""
        src = open(os.path.join(root, rel)).read() if root else ""
    except (ImportError, ValueError, OSError, IndexError):
        return False
    return any(line.startswith(("import torchvision", "from torchvision")) for line in src.splitlines())


def install_cpu_stubs() -> list[str]:
    """Install the stand-ins that this environment lacks (idempotent); returns their names."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return STUBBED
    exact: tuple[str, ...] = ()
    try:
        import torchvision  # noqa: F401
    except Exception:       # absent, or a CUDA build over a CPU torch (its ops fail to load)
        sys.modules.pop("torchvision", None)
        exact = TORCHVISION_USERS
        if _imports_torchvision("srt/utils/common.py"):    # e.g. 0.5.12: decode_jpeg at import
            exact, roots_tv = (), ("torchvision",)
        else:
            roots_tv = ()
    else:
        roots_tv = ()
    roots = roots_tv + tuple(m for m in CUDA_ONLY if _missing(m))
    if exact or roots:
        sys.meta_path.insert(0, _StubFinder(exact, roots))
    return STUBBED


class _idempotent_autoconfig_register:
    """While SGLang imports: transformers' AutoConfig.register with exist_ok=True. Some releases
    register config names that a newer transformers already has ('qwen3_asr' on 0.5.12 with
    transformers 5.24), which raises; the caches need none of those configs."""

    def __enter__(self) -> None:
        try:
            from transformers import AutoConfig
        except Exception:
            self.cls = None
            return
        self.cls, self.real = AutoConfig, AutoConfig.__dict__["register"]
        real = AutoConfig.register

        def register(model_type: str, config: Any, exist_ok: bool = False) -> Any:
            try:
                from transformers.models.auto.configuration_auto import CONFIG_MAPPING
                dup = model_type in CONFIG_MAPPING
            except Exception:
                dup = False
            if dup and "AutoConfig.register(exist_ok=True)" not in STUBBED:
                STUBBED.append("AutoConfig.register(exist_ok=True)")
            return real(model_type, config, exist_ok=True)
        AutoConfig.register = staticmethod(register)

    def __exit__(self, *exc: Any) -> None:
        if self.cls is not None:
            self.cls.register = self.real


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


# class name -> module (a class absent from a release is simply not listed)
CLASSES = {
    "RadixCache": "sglang.srt.mem_cache.radix_cache",
    "PureSWARadixCache": "sglang.srt.mem_cache.pure_swa_radix_cache",
    "SWARadixCache": "sglang.srt.mem_cache.swa_radix_cache",
    "MambaRadixCache": "sglang.srt.mem_cache.mamba_radix_cache",
    "HiRadixCache": "sglang.srt.mem_cache.hiradix_cache",
    "ChunkCache": "sglang.srt.mem_cache.chunk_cache",
    "UnifiedRadixCache": "sglang.srt.mem_cache.unified_radix_cache",
}
CLASSES_PARAMS = "sglang.srt.mem_cache.cache_init_params"
_LOADED: dict[str, Any] = {}


def load() -> dict[str, Any]:
    """Import what the adapter uses; raises SglangUnavailable with a one-line reason."""
    if _LOADED:
        return _LOADED
    if sglang_version() is None:
        raise SglangUnavailable(INSTALL_HINT)
    os.environ.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
    # a Triton kernel SGLang's own code launches (0.5.15-0.5.21's paged allocator extends a request
    # only through one) runs in Triton's own CPU interpreter: SGLang's kernel as written, no GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    install_cpu_stubs()
    import warnings
    with warnings.catch_warnings(), _idempotent_autoconfig_register():
        warnings.simplefilter("ignore")
        try:
            from sglang.srt.mem_cache import base_prefix_cache as bpc
            from sglang.srt.mem_cache import allocator as al
            from sglang.srt.mem_cache import radix_cache as rc
            # CacheInitParams from 0.5.6, RadixKey from 0.5.3 (compat.py builds without them)
            cip = importlib.import_module(CLASSES_PARAMS) if not _missing(CLASSES_PARAMS) else None
        except Exception as e:   # a release whose chain needs something this environment lacks
            raise SglangUnavailable(f"sglang {sglang_version()} does not import here (kvcheck drives "
                                    f"{OLDEST}..{NEWEST}): {type(e).__name__}: {e}") from None
        found: dict[str, Any] = {}
        for cls, mod in CLASSES.items():
            if _missing(mod):
                continue
            try:
                found[cls] = getattr(importlib.import_module(mod), cls)
            except Exception as e:
                found[cls] = SglangUnavailable(f"{cls} does not import: {type(e).__name__}: {e}")
    _LOADED.update(bpc=bpc, allocator=al, CacheInitParams=getattr(cip, "CacheInitParams", None),
                   RadixKey=getattr(rc, "RadixKey", None),
                   classes=found, version=sglang_version())
    return _LOADED


def cache_class(name: str) -> Any:
    """The class of the installed release; SglangUnavailable when the release lacks it."""
    found = load()["classes"]
    c = found.get(name)
    if c is None:
        raise SglangUnavailable(f"sglang {sglang_version()} has no {name} "
                                f"(it has: {', '.join(k for k, v in found.items() if isinstance(v, type))})")
    if isinstance(c, Exception):
        raise c
    return c


def summary() -> str:
    """One line for scripts/install-sglang.sh: 'ok classes: ... | CPU stand-ins: ...', or why not."""
    try:
        found = load()["classes"]
    except SglangUnavailable as e:
        return str(e)
    ok = [k for k, v in found.items() if isinstance(v, type)]
    bad = [k for k, v in found.items() if not isinstance(v, type)]
    return (f"ok classes: {', '.join(ok) or 'none'}" + (f" (not importable: {', '.join(bad)})" if bad else "")
            + f" | CPU stand-ins: {', '.join(STUBBED) or 'none'}")
