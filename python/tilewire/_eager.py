"""How an eager call of an op reaches the library: through torch's dispatcher (the custom op),
directly, or by the fast lane.

The direct path. A torch.library.custom_op call spends more host time in eager mode (the
dispatcher, autograd and in-place bookkeeping) than the C call it wraps. Where nothing needs
the dispatcher (no torch.compile tracing, plain tensors, no dispatch or function mode, no
autograd to record), the public functions call the op's implementation directly and bump the
mutated tensors' version counters as the dispatcher would; anything else goes through
torch.ops.tilewire.*. TILEWIRE_EAGER_DISPATCH=1 forces the dispatcher path.

The fast lane. On the direct path, the argument checks and the ctypes args struct built field
by field are still most of a call's host time. So a call that ran directly and reached the
library leaves its args struct here, under the call's signature: every tensor's shape,
strides, dtype and device, the scalar arguments with their types, and, where a check reads
them, the symmetric tensors' addresses with their comm's allocation generation. A later
direct call with the same signature passed the same checks, so it copies the struct, sets the
data pointers that may change (checked 16-byte aligned), and calls the library, which still
validates every argument. Anything else (a new signature, a misaligned pointer, a call the
direct path refuses) goes the whole way. TILEWIRE_FAST_LANE=0 turns the lane off. Not while
torch.compile traces (dynamo cannot trace the signature's hash; the traced op is the custom
op anyway).

``python -m tilewire.bench_dist --host`` measures each path's host time per call.
"""

import os

import torch

from ._glue import _HAVE_CUSTOM_OP

# ---- the direct path ----------------------------------------------------------------------

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
    lambda: False)
try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # an old torch: always the dispatcher
    _get_current_dispatch_mode = None
_torch_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", None)
# One tensor per call: torch's public wrapper takes a tensor in every version that has it
# (the private function it wraps takes an iterable of tensors in recent torch: given one
# tensor it would iterate over its elements).
_increment_version = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
_FAST_EAGER = (_HAVE_CUSTOM_OP and _get_current_dispatch_mode is not None
               and _torch_function_mode is not None and _increment_version is not None
               and os.environ.get("TILEWIRE_EAGER_DISPATCH", "0") in ("", "0"))


# Tensor types the direct path takes: plain tensors and nn.Parameter, whose __torch_function__
# is torch's disabled default (a model's weights are Parameters; any other subclass may
# override dispatch, so it goes through the dispatcher).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct_ok(tensors, mutated):
    """True when an op call on `tensors` (None entries ignored) that writes `mutated` can skip
    the dispatcher (the direct path, above)."""
    if not _FAST_EAGER or _is_compiling() or _get_current_dispatch_mode() is not None \
            or _torch_function_mode():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    if not torch.is_inference_mode_enabled():
        for t in mutated:
            if t.is_inference():  # the dispatcher raises the right error for these
                return False
    return True


def _mutated(tensors):
    """What the dispatcher's in-place bookkeeping does for a mutating op's written tensors
    (outside inference mode, where tensors have no version counter)."""
    if not torch.is_inference_mode_enabled():
        for t in tensors:
            _increment_version(t)


def _call_mutating(dispatched, impl, tensors, mutated, *args):
    """One call of a mutating op: its implementation impl(*args) directly where nothing needs
    the dispatcher (or torch has no custom ops), else dispatched(*args), the call of its
    torch.ops.tilewire op (spelled out at each call site, as torch.compile traces it).
    tensors: the call's tensors (None allowed); mutated: those it writes. Returns what impl
    returned when it ran directly (the fast lane's args struct), else None."""
    if _direct_ok(tensors, mutated):
        _mutated(mutated)
        return impl(*args)
    if _HAVE_CUSTOM_OP:
        dispatched(*args)
    else:
        impl(*args)
    return None


# ---- the fast lane ------------------------------------------------------------------------

_LANE_MAX = 1024
_lane = {}
_LANE_ON = _FAST_EAGER and os.environ.get("TILEWIRE_FAST_LANE", "1") in ("", "1")


def _lane_open(*tensors):
    """The lane may be tried: it is on, torch.compile is not tracing, and every tensor given
    (None: not given) is plain (a non-tensor goes the whole way, which raises)."""
    if not _LANE_ON or _is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _lane_find(*parts):
    """(the signature tuple, the lane's entry for it or None), hashing it once; (None, None)
    where a part is unhashable (that call goes the whole way and raises what it should)."""
    try:
        return parts, _lane.get(parts)
    except TypeError:
        return None, None


def _lane_put(key, entry):
    """entry: (args struct, anything else the hit needs); the struct is copied."""
    if key is None or entry is None or entry[0] is None:
        return
    if len(_lane) >= _LANE_MAX:
        _lane.clear()
    _lane[key] = (_lane_args(entry[0]),) + tuple(entry[1:])


def _lane_args(tmpl):
    return type(tmpl).from_buffer_copy(tmpl)
