"""How the installed transformers release takes and returns a model's cache: the one place kvcheck
passes a cache to a model and reads one back (docs/adapters-transformers.md, "One interface per
release").

transformers renamed the cache argument (`past_key_values=` up to 5.16, `cache=` in 5.24; the
Mamba family's `cache_params=`) and the output field that returns it, and every `forward` takes
`**kwargs`: a keyword of another release is swallowed without a word and the model runs without
the cache, so a reuse run would compare a recompute of the suffix alone with the full forward
and report a divergence that is kvcheck's. So:

- the keyword is the explicit parameter of the model class's own `forward` signature among
  `CACHE_KEYWORDS` (inspected once per class), never one a release may swallow;
- the cache comes back from the output field the output class declares (`cache`,
  `past_key_values`, `cache_params`; never a deprecated alias property);
- after a call made with a cache, the returned cache must be the one passed (updated in place)
  or hold the prefix (its sequence length grew by the call's tokens); otherwise the model did not
  use it and kvcheck cannot drive this release (`CannotDrive`, exit 3), never a divergence.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

from kvcheck.fuzz.boundary import CannotDrive, as_cannot_drive

ENGINE = "transformers"
PACKAGES = ("transformers",)
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")    # newest first
_ROOT = Path(__file__).resolve().parents[3]                        # the repository (kvcheck's parent)


def release() -> str | None:
    """The transformers release this process runs (the imported module's own version)."""
    mod = sys.modules.get("transformers")
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    try:
        from importlib import metadata
        return metadata.version("transformers")
    except Exception:  # noqa: BLE001 - the release is only named in a message
        return None


def here(depth: int = 0) -> str:
    """``file:line (function)`` of the line calling `here` (``depth`` 0) or of its caller
    ``depth`` frames up: the `where` of a CannotDrive, the kvcheck code that relies on something."""
    f = sys._getframe(depth + 1)
    try:
        name = str(Path(f.f_code.co_filename).resolve().relative_to(_ROOT))
    except ValueError:
        name = f.f_code.co_filename
    return f"{name}:{f.f_lineno} ({f.f_code.co_name})"


def _signature(cls: type) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError, AttributeError):
        return None


def cache_parameters(cls: type) -> tuple[str, ...]:
    """The cache parameters ``cls.forward`` declares explicitly (by name or keyword), newest first;
    inspected once per forward function (a class's, or a replaced one's)."""
    fn = getattr(cls, "forward", None)
    return _declared(fn) if fn is not None else ()


def _declared(forward: Any) -> tuple[str, ...]:
    return _explicit(forward, CACHE_KEYWORDS)


@functools.lru_cache(maxsize=None)
def _explicit(forward: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that ``forward`` declares by name (never only through ``**kwargs``)."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return ()
    ok = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in names if k in params and params[k].kind in ok)


def cache_keyword(model: Any) -> str:
    """The keyword this release's ``type(model).forward`` takes the cache by; CannotDrive when its
    signature declares none (a cache passed by any name would go into ``**kwargs``)."""
    cls = model if isinstance(model, type) else type(model)
    found = cache_parameters(cls)
    if not found:
        raise CannotDrive(ENGINE, release(), (
            f"{cls.__name__}.forward declares none of the cache parameters kvcheck knows "
            f"({', '.join(CACHE_KEYWORDS)}), so a cache passed by any of those names would be swallowed by "
            f"its **kwargs; its signature: {_signature(cls)}"), here(1))
    return found[0]


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call of ``model`` continuing ``cache``."""
    return {cache_keyword(model): cache}


def output_fields(out: Any) -> list[str]:
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [f.name for f in dataclasses.fields(out)]
    if isinstance(out, dict):
        return list(out)
    return []


def returned_cache(out: Any, keyword: str | None = None) -> Any:
    """The cache a forward returned: the output field named like the keyword the release takes
    (when given), else the first of `CACHE_KEYWORDS` the output class declares; None if none."""
    declared = set(output_fields(out))
    names = ([keyword] if keyword else []) + [k for k in CACHE_KEYWORDS if k != keyword]
    for name in names:
        if name in declared:
            value = getattr(out, name, None)
            if value is None and isinstance(out, dict):
                value = out.get(name)
            if value is not None:
                return value
    return None


def seq_length(cache: Any) -> int | None:
    """The number of tokens ``cache`` has seen (its ``get_seq_length()``); None if it cannot say."""
    fn = getattr(cache, "get_seq_length", None)
    if not callable(fn):
        return None
    try:
        n = fn()
    except Exception:  # noqa: BLE001 - a cache with no attention layer cannot say; identity decides
        return None
    return int(n) if isinstance(n, int) or hasattr(n, "__index__") else None


def check_used(model: Any, passed: Any, before: int | None, got: Any, tokens: int, where: str) -> None:
    """CannotDrive unless the call of ``model`` that was given ``passed`` (holding ``before``
    tokens) and ``tokens`` new tokens used it: ``got`` is ``passed`` itself (updated in place), or
    it holds ``before + tokens`` tokens (``before`` > 0, so a fresh cache of only the new tokens
    never counts)."""
    if got is not None and got is passed:
        return
    after = seq_length(got) if got is not None else None
    if got is not None and before and after == before + tokens:
        return
    cls = type(model)
    key = cache_keyword(model)
    if got is None:
        returned = "returned no cache"
    else:
        returned = (f"returned a new {type(got).__name__}"
                    + (f" holding {after} tokens instead of {before} + {tokens}" if after is not None else ""))
    raise CannotDrive(ENGINE, release(), (
        f"kvcheck passed the cache as {key}= to {cls.__name__}.forward and the model ignored it ({returned}); "
        f"the forward's cache parameters: {', '.join(cache_parameters(cls)) or 'none'}"), where)


def call_with_cache(model: Any, cache: Any, call: Any = None, past: int | None = None,
                    **kw: Any) -> tuple[Any, Any]:
    """``model(**kw)`` (or ``call(**kw)``, a wrapper that calls it) continuing ``cache`` by the
    keyword this release takes: (output, returned cache); CannotDrive when the model did not use
    the cache (`check_used`), naming kvcheck's caller as where it relies on the keyword.
    ``past``: the tokens ``cache`` holds (else its own count): where the forward declares
    ``cache_position`` the new tokens' positions are passed, as generate() passes them (5.0's
    Mamba family refuses a cache without them)."""
    where = here(1)
    key = cache_keyword(model)
    before = seq_length(cache)
    ids = kw.get("input_ids")
    tokens = int(ids.shape[1]) if ids is not None else int(kw["inputs_embeds"].shape[1])
    start = past if past is not None else before
    if start is not None and "cache_position" not in kw and takes_positions(type(model)):
        import torch
        kw["cache_position"] = torch.arange(start, start + tokens)
    out = (call or model)(**kw, **{key: cache})
    got = returned_cache(out, key)
    check_used(model, cache, before, got, tokens, where)
    return out, got


def prefill(model: Any, ids: Any, call: Any = None) -> tuple[Any, Any]:
    """(output, cache) of a first call with ``use_cache=True``: the cache the model returns; where
    the release's model returns none unless handed one (5.0-5.x's Bamba, FalconH1: their cache
    class is made by ``prepare_inputs_for_generation``), the one its generate() would start with,
    passed by the release's keyword; (output, None) when neither gives one."""
    out = (call or model)(input_ids=ids, use_cache=True)
    got = returned_cache(out)
    if got is not None:
        return out, got
    start = generation_cache(model, ids)
    if start is None:
        return out, None
    return call_with_cache(model, start, call=call, past=0, input_ids=ids, use_cache=True)


def generation_cache(model: Any, ids: Any) -> Any:
    """The cache object the release's ``prepare_inputs_for_generation`` starts a generation with
    (None: it makes none, or cannot be asked)."""
    prep = getattr(model, "prepare_inputs_for_generation", None)
    if not callable(prep):
        return None
    declared = cache_parameters(type(model))
    if not declared:                   # no cache parameter: nothing a generation could hand it
        return None
    import torch
    key = declared[0]
    try:
        inputs = prep(ids, **{key: None}, use_cache=True, cache_position=torch.arange(ids.shape[1]))
    except Exception:  # noqa: BLE001 - a release that cannot be asked this way: no starting cache
        return None
    found = inputs.get(key) if isinstance(inputs, dict) else None
    return found if found is not None and hasattr(found, "get_seq_length") else None


def declares(cls: type, name: str) -> bool:
    """Whether ``cls.forward`` declares the parameter ``name`` by name (not only via ``**kwargs``)."""
    fn = getattr(cls, "forward", None)
    return fn is not None and bool(_explicit(fn, (name,)))


def takes_positions(cls: type) -> bool:
    """Whether ``cls.forward`` declares ``cache_position`` by name (the release's own interface)."""
    return declares(cls, "cache_position")


def classify(exc: BaseException) -> CannotDrive | None:
    """CannotDrive for an exception raised on kvcheck's side of the boundary with transformers
    (`kvcheck.fuzz.boundary.blame`), None when it is transformers' own."""
    return as_cannot_drive(exc, ENGINE, release(), PACKAGES)


# -- rolling a cache back (assisted decoding: draft, roll back, continue; assist.py) -----------
# `Cache.crop`'s argument changed meaning across releases: 5.24 `crop(tokens_to_remove)` takes a
# negative count of tokens to remove (and refuses a positive one); 5.0.0 `crop(max_length)` (and
# the model caches of that era, e.g. lfm2's `crop(max_length)`) the absolute length to keep. The
# meaning is read from the name of the first parameter of the installed release's `crop`, never
# guessed from a call that may succeed with the other meaning.
CROP_REMOVE = "remove"          # crop(-n): remove the last n tokens
CROP_ABSOLUTE = "absolute"      # crop(L): keep the first L tokens
CROP_PARAMETERS = {"tokens_to_remove": CROP_REMOVE, "max_length": CROP_ABSOLUTE, "maximum_length": CROP_ABSOLUTE}


@functools.lru_cache(maxsize=None)
def _crop_parameter(crop: Any) -> str | None:
    try:
        params = [p for p in inspect.signature(crop).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return None
    return params[0].name if params else None


def crop_convention(cache: Any) -> str | None:
    """`CROP_REMOVE` or `CROP_ABSOLUTE` for ``type(cache).crop`` (inspected once per function);
    None when the cache class has no ``crop`` (the release cannot roll it back: unsupported);
    CannotDrive when it has one whose parameter kvcheck does not know (it would pass a number
    whose meaning it cannot tell)."""
    crop = getattr(type(cache), "crop", None)
    if not callable(crop):
        return None
    name = _crop_parameter(crop)
    if name in CROP_PARAMETERS:
        return CROP_PARAMETERS[name]
    raise CannotDrive(ENGINE, release(), (
        f"{type(cache).__name__}.crop takes {name!r}, none of the crop parameters kvcheck knows "
        f"({', '.join(f'{k} ({v})' for k, v in CROP_PARAMETERS.items())}); its signature: "
        f"{inspect.signature(crop) if name is not None else '?'}"), here(1))


def crop_argument(convention: str, length: int, keep: int) -> int:
    """The argument of ``crop`` that rolls a cache holding ``length`` tokens back to ``keep``."""
    if not 0 <= keep <= length:
        raise ValueError(f"cannot crop {length} tokens to {keep}")
    return -(length - keep) if convention == CROP_REMOVE else keep


def crop_to(cache: Any, length: int, keep: int) -> tuple[str, int]:
    """Roll ``cache`` (holding ``length`` tokens) back to ``keep`` by the installed release's own
    convention: (convention, argument passed). Raises what the release's crop raises."""
    conv = crop_convention(cache)
    if conv is None:
        raise AttributeError(f"{type(cache).__name__} has no crop")
    arg = crop_argument(conv, length, keep)
    cache.crop(arg)
    return conv, arg


def past_recording(cache: Any) -> Any:
    """The release's switch that makes a cache keep what a later crop needs (5.24
    ``Cache.activate_past_recording``), or None on a release without it."""
    fn = getattr(cache, "activate_past_recording", None)
    return fn if callable(fn) else None


def not_croppable(cache: Any, model: Any = None) -> str | None:
    """Why the release documents ``cache`` (of ``model``) as not rollable: the model class's
    ``_is_stateful`` (transformers' own flag that makes ``generate()`` refuse assisted decoding:
    its state cannot be rewound, e.g. DeepSeek-V4's compressor), or 5.24 ``Cache.is_croppable``
    False (with its layers that say so); None when it says croppable or does not say."""
    cls = None if model is None else (model if isinstance(model, type) else type(model))
    why = []
    flag = getattr(cache, "is_croppable", None)
    if flag is not None and not bool(flag):
        layers = [f"{i}:{type(x).__name__}" for i, x in enumerate(getattr(cache, "layers", []))
                  if getattr(x, "is_croppable", True) is False]
        why.append(f"{type(cache).__name__}.is_croppable is False on transformers {release()}"
                   + (f" (layers {', '.join(layers)})" if layers else ""))
    if cls is not None and getattr(cls, "_is_stateful", False) is True:
        why.append(f"{cls.__name__}._is_stateful is True on transformers {release()} (the release declares its "
                   "state cannot be rolled back: generate() refuses assisted decoding for it)")
    return "; ".join(why) or None


# -- generate() continuing a cache (the reuse paths users take; paths.py) ----------------------
def generate_with_cache(model: Any, cache: Any, past: int, **kw: Any) -> Any:
    """``model.generate(**kw)`` handed ``cache`` (holding ``past`` tokens) by the keyword this
    release's forward declares (generate passes its model kwargs on to forward under the same
    name: ``past_key_values=`` up to 5.16, ``cache=`` in 5.24); CannotDrive when generate did not
    continue it (the cache neither came back nor grew by the tokens generate fed)."""
    where = here(1)
    key = cache_keyword(model)
    out = model.generate(**kw, **{key: cache})
    seqs = getattr(out, "sequences", out)
    fed = int(seqs.shape[1]) - 1 - past          # every token but the last one goes through forward
    got = returned_cache(out, key)
    after = seq_length(cache)
    if got is cache or (after is not None and after == past + fed and past > 0):
        return out
    raise CannotDrive(ENGINE, release(), (
        f"kvcheck handed generate() a {type(cache).__name__} holding {past} tokens as {key}= and it did not continue "
        f"it (the cache {'holds ' + str(after) if after is not None else 'cannot say how many'} tokens after "
        f"{fed} were fed; its output returned {type(got).__name__ if got is not None else 'no cache'})"), where)
