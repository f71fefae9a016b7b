"""The CPU stand-ins of a standalone SGLang reproducer (spliced into sglang_repro_template.TEMPLATE).

The script must import SGLang on a machine without its GPU packages, as kvcheck does
(install.py): stand-ins for `sgl_kernel` and the CUDA-built torchvision users, and
transformers' `AutoConfig.register` made idempotent; each only where the real module is
missing (marked KVCHECK_CPU_STUB, unused on a GPU install). Kept apart from the driver: it is
the same for every class, and mirrors the adapter's install path rather than its checks.
"""

STAND_INS = r'''# ---- CPU stand-ins (KVCHECK_CPU_STUB), only for modules this machine lacks: SGLang's import
# ---- chain reaches GPU-only packages the caches never call. Unused on a GPU install.
class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Any()
    def __getattr__(self, n):
        if n.startswith("__"): raise AttributeError(n)
        return _Any()


class _Stub(types.ModuleType):
    __path__ = []
    def __getattr__(self, n):
        if n.startswith("__"): raise AttributeError(n)
        if n.endswith("Config"):
            from transformers import PretrainedConfig
            c = type(n, (PretrainedConfig,), {"model_type": "stub_" + n.lower()}); setattr(self, n, c); return c
        return _Any()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, exact, roots): self.exact, self.roots = exact, roots
    def find_spec(self, name, path, target=None):
        if name in self.exact or name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec): return _Stub(spec.name)
    def exec_module(self, m):
        m.KVCHECK_CPU_STUB = True
        if m.__name__ == "torchvision": m.__version__ = "0.0.0+cpu.stub"


def _missing(mod):
    try: return importlib.util.find_spec(mod) is None
    except (ImportError, ValueError): return True


exact, roots = (), tuple(m for m in ("sgl_kernel",) if _missing(m))
try:
    import torchvision  # noqa: F401
except Exception:       # absent, or a CUDA build over a CPU torch
    sys.modules.pop("torchvision", None)
    root = importlib.util.find_spec("sglang").submodule_search_locations[0]
    src = open(os.path.join(root, "srt/utils/common.py")).read() if os.path.exists(os.path.join(root, "srt/utils/common.py")) else ""
    if any(l.startswith(("import torchvision", "from torchvision")) for l in src.splitlines()):
        roots += ("torchvision",)
    else:
        exact = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr")
if exact or roots:
    sys.meta_path.insert(0, _Finder(exact, roots))
os.environ.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
import warnings; warnings.simplefilter("ignore")
import torch
try:
    from transformers import AutoConfig
    _reg = AutoConfig.register      # some releases register names newer transformers has
    AutoConfig.register = staticmethod(lambda t, c, exist_ok=False: _reg(t, c, exist_ok=True))
except Exception:
    pass
# ---- end of CPU stand-ins
'''
