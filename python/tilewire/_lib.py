"""ctypes binding of include/tilewire.h: every constant, enum, struct and function.

The library is loaded on first use (so ``import tilewire`` works before it is built), from
the first of:

1. ``$TILEWIRE_LIB``: the path of libtilewire.so, or a folder holding it;
2. the package folder: the copy ``pip install .`` puts there, under its soname
   (libtilewire.so.MAJOR, which the package's tw-bench finds beside it), or libtilewire.so;
3. ``build/`` of the source tree this package sits in (``python/tilewire/../../build``);
4. the system's library search path (``ctypes.util.find_library("tilewire")``).

``call(name, *args, comm=handle)`` calls a function and raises the TilewireError subclass of
a failed status, with tw_comm_last_error(comm) (or tw_last_error()) as the message.

Adding a function to tilewire.h: add one line to ``FUNCTIONS`` below (the layout test
checks that the table matches the header's TW_API declarations, argument for argument).
"""

import ctypes
import ctypes.util
import enum
import os
import pathlib
import threading

from ._errors import Status, error_for

# ---- constants (tilewire.h #defines) ------------------------------------------------------

TW_VERSION_MAJOR = 0
TW_VERSION_MINOR = 1
TW_VERSION_PATCH = 0
TW_VERSION_CODE = TW_VERSION_MAJOR * 10000 + TW_VERSION_MINOR * 100 + TW_VERSION_PATCH
TW_MAX_WORLD = 64
TW_UNIQUE_ID_BYTES = 128
TW_CONFIG_VERSION = 1
TW_GEMM_ARGS_VERSION = 3
TW_GEMM_WORKSPACE_BYTES = 9 << 20  # tw_gemm_args_t.workspace's size (version 3)
TW_AG_GEMM_ARGS_VERSION = 2
TW_GEMM_RS_ARGS_VERSION = 3
TW_MOE_ARGS_VERSION = 3
TW_GROUPED_GEMM_ARGS_VERSION = 1
TW_ATTENTION_ARGS_VERSION = 1
TW_ATTENTION_BACKWARD_ARGS_VERSION = 2
TW_RING_ATTENTION_ARGS_VERSION = 1
TW_RING_ATTENTION_BACKWARD_ARGS_VERSION = 1
TW_RING_CONTIGUOUS = 0
TW_RING_ZIGZAG = 1

# ---- enums --------------------------------------------------------------------------------


class DType(enum.IntEnum):
    """tw_dtype_t (TW_BF16, ...)."""

    BF16 = 0
    FP16 = 1
    FP32 = 2


class TileOrder(enum.IntEnum):
    """tw_tile_order_t (TW_TILE_ORDER_DEFAULT, ...)."""

    DEFAULT = 0
    ROW_MAJOR = 1
    ROTATED = 2


class AgCommMode(enum.IntEnum):
    """tw_ag_comm_mode_t (TW_AG_COMM_SM, TW_AG_COMM_COPY_ENGINE, TW_AG_COMM_AUTO)."""

    SM = 0
    COPY_ENGINE = 1
    AUTO = 2


class Partials(enum.IntEnum):
    """tw_partials_t (TW_PARTIALS_FP32, TW_PARTIALS_BF16): gemm_rs / gemm_ar partial precision."""

    FP32 = 0
    BF16 = 1


# Each Python enum with the C typedef it mirrors and the prefix of its C constant names.
ENUMS = {
    "tw_status_t": (Status, "TW_"),
    "tw_dtype_t": (DType, "TW_"),
    "tw_tile_order_t": (TileOrder, "TW_TILE_ORDER_"),
    "tw_ag_comm_mode_t": (AgCommMode, "TW_AG_COMM_"),
    "tw_partials_t": (Partials, "TW_PARTIALS_"),
}

# ---- structs ------------------------------------------------------------------------------

# Opaque handles: tw_comm_t is `struct tw_comm *`, tw_stream_t is `cudaStream_t`.
tw_comm_t = ctypes.c_void_p
tw_stream_t = ctypes.c_void_p
c_enum = ctypes.c_int  # a C enum is an int on every ABI tilewire supports (x86-64, aarch64)


class UniqueId(ctypes.Structure):
    """tw_unique_id_t: 128 opaque bytes; ``bytes(uid)`` and ``UniqueId.from_bytes(b)``."""

    _fields_ = [("internal", ctypes.c_char * TW_UNIQUE_ID_BYTES)]

    @classmethod
    def from_bytes(cls, data):
        data = bytes(data)
        if len(data) != TW_UNIQUE_ID_BYTES:
            raise ValueError(
                "unique id: expected %d bytes, got %d" % (TW_UNIQUE_ID_BYTES, len(data))
            )
        return cls.from_buffer_copy(data)


class _Versioned(ctypes.Structure):
    """A struct whose first fields are `size` and `version`, filled as its _INIT macro does."""

    _version_ = 0
    _defaults_ = {}  # fields whose _INIT value is not zero

    def __init__(self, **fields):
        super().__init__()
        cls = type(self)
        names = cls.__dict__.get("_names_")
        if names is None:  # per class, once (a call's args struct is made on every call)
            names = cls._names_ = frozenset(cls._field_names())
        self.size = ctypes.sizeof(self)
        self.version = self._version_
        for source in (self._defaults_, fields):
            for name, value in source.items():
                if name not in names:
                    raise TypeError(
                        "%s has no field %r (fields: %s)"
                        % (cls.__name__, name, ", ".join(self._field_names()))
                    )
                setattr(self, name, value)

    @classmethod
    def _field_names(cls):
        return [f[0] for f in cls._fields_]

    def __repr__(self):
        values = ", ".join("%s=%r" % (n, getattr(self, n)) for n in self._field_names())
        return "%s(%s)" % (type(self).__name__, values)


class Config(_Versioned):
    """tw_config_t; ``Config()`` equals TW_CONFIG_INIT. Zero in a field means "default"."""

    _version_ = TW_CONFIG_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("sm_budget", ctypes.c_int32),
        ("ranks_per_node", ctypes.c_int32),
        ("bootstrap_timeout_ms", ctypes.c_int32),
        ("wait_timeout_ms", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("heap_bytes", ctypes.c_uint64),
    ]


class GemmArgs(_Versioned):
    """tw_gemm_args_t; ``GemmArgs()`` equals TW_GEMM_ARGS_INIT."""

    _version_ = TW_GEMM_ARGS_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("c_dtype", c_enum),  # tw_dtype_t
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("lda", ctypes.c_int64),
        ("ldb", ctypes.c_int64),
        ("ldc", ctypes.c_int64),
        ("sm_count", ctypes.c_int32),
        ("tile_order", ctypes.c_int32),  # tw_tile_order_t
        ("rotate_start", ctypes.c_int64),
        ("split_k", ctypes.c_int32),  # version 2: K slices per tile (0/1 none, 2/4/8, -1 auto)
        ("workspace", ctypes.c_void_p),  # version 3: scratch for split_k -1 (NULL: none)
        ("workspace_bytes", ctypes.c_size_t),
    ]


class GroupedGemmArgs(_Versioned):
    """tw_grouped_gemm_args_t; ``GroupedGemmArgs()`` equals TW_GROUPED_GEMM_ARGS_INIT."""

    _version_ = TW_GROUPED_GEMM_ARGS_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("c_dtype", c_enum),  # tw_dtype_t of out
        ("a", ctypes.c_void_p),  # [m, k]
        ("b", ctypes.c_void_p),  # [groups][n, k]
        ("out", ctypes.c_void_p),  # [m, n]
        ("offsets", ctypes.c_void_p),  # const int32_t *, device memory, [groups + 1]
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("groups", ctypes.c_int64),
        ("lda", ctypes.c_int64),
        ("ldb", ctypes.c_int64),
        ("ldo", ctypes.c_int64),
        ("sm_count", ctypes.c_int32),
    ]


class AttentionArgs(_Versioned):
    """tw_attention_args_t; ``AttentionArgs()`` equals TW_ATTENTION_ARGS_INIT."""

    _version_ = TW_ATTENTION_ARGS_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("causal", ctypes.c_int32),
        ("q", ctypes.c_void_p),  # bf16 [batch, seq_q, heads_q, head_dim]
        ("k", ctypes.c_void_p),  # bf16 [batch, seq_kv, heads_kv, head_dim]
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),  # bf16 [batch, seq_q, heads_q, head_dim]
        ("lse", ctypes.c_void_p),  # fp32 [batch, heads_q, seq_q] or NULL
        ("batch", ctypes.c_int64),
        ("heads_q", ctypes.c_int64),
        ("heads_kv", ctypes.c_int64),
        ("seq_q", ctypes.c_int64),
        ("seq_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("q_offset", ctypes.c_int64),
        ("kv_offset", ctypes.c_int64),
        ("softmax_scale", ctypes.c_float),
        ("sm_count", ctypes.c_int32),
    ]


class AttentionBackwardArgs(_Versioned):
    """tw_attention_backward_args_t; ``AttentionBackwardArgs()`` equals
    TW_ATTENTION_BACKWARD_ARGS_INIT."""

    _version_ = TW_ATTENTION_BACKWARD_ARGS_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("causal", ctypes.c_int32),
        ("q", ctypes.c_void_p),  # bf16 [batch, seq_q, heads_q, head_dim]
        ("k", ctypes.c_void_p),  # bf16 [batch, seq_kv, heads_kv, head_dim]
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),  # bf16, q's shape: the forward's output
        ("dout", ctypes.c_void_p),  # bf16, q's shape: the gradient of o
        ("lse", ctypes.c_void_p),  # const float * [batch, heads_q, seq_q]: the forward's
        ("dq", ctypes.c_void_p),  # bf16, q's shape, written
        ("dk", ctypes.c_void_p),  # bf16, k's shape, written
        ("dv", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),  # float * [batch, heads_q, seq_q], written
        ("batch", ctypes.c_int64),
        ("heads_q", ctypes.c_int64),
        ("heads_kv", ctypes.c_int64),
        ("seq_q", ctypes.c_int64),
        ("seq_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("q_offset", ctypes.c_int64),
        ("kv_offset", ctypes.c_int64),
        ("softmax_scale", ctypes.c_float),
        ("sm_count", ctypes.c_int32),
        ("dq_accum", ctypes.c_void_p),  # version 2: fp32 scratch of the one-pass backward
    ]


class RingAttentionArgs(_Versioned):
    """tw_ring_attention_args_t; ``RingAttentionArgs()`` equals TW_RING_ATTENTION_ARGS_INIT."""

    _version_ = TW_RING_ATTENTION_ARGS_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("causal", ctypes.c_int32),
        ("q", ctypes.c_void_p),  # bf16 [batch, seq_local, heads_q, head_dim]
        ("k", ctypes.c_void_p),  # bf16 [batch, seq_local, heads_kv, head_dim], symmetric
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),  # fp32 [batch, heads_q, seq_local] or NULL
        ("batch", ctypes.c_int64),
        ("heads_q", ctypes.c_int64),
        ("heads_kv", ctypes.c_int64),
        ("seq_local", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("softmax_scale", ctypes.c_float),
        ("layout", ctypes.c_int32),
        ("sm_count", ctypes.c_int32),
        ("gathered", ctypes.c_void_p),  # across nodes: symmetric, else NULL
    ]
    _defaults_ = {"layout": TW_RING_ZIGZAG}


class RingAttentionBackwardArgs(_Versioned):
    """tw_ring_attention_backward_args_t; ``RingAttentionBackwardArgs()`` equals
    TW_RING_ATTENTION_BACKWARD_ARGS_INIT."""

    _version_ = TW_RING_ATTENTION_BACKWARD_ARGS_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("causal", ctypes.c_int32),
        ("q", ctypes.c_void_p),  # bf16 [batch, seq_local, heads_q, head_dim], symmetric
        ("k", ctypes.c_void_p),  # bf16 [batch, seq_local, heads_kv, head_dim], symmetric
        ("v", ctypes.c_void_p),  # symmetric
        ("o", ctypes.c_void_p),  # bf16, q's shape: the forward's output
        ("dout", ctypes.c_void_p),  # bf16, q's shape: the gradient of o, symmetric
        ("lse", ctypes.c_void_p),  # const float * [batch, heads_q, seq_local], symmetric
        ("dq", ctypes.c_void_p),  # bf16, q's shape, written
        ("dk", ctypes.c_void_p),  # bf16, k's shape, written
        ("dv", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),  # float * [batch, heads_q, seq_local], symmetric
        ("batch", ctypes.c_int64),
        ("heads_q", ctypes.c_int64),
        ("heads_kv", ctypes.c_int64),
        ("seq_local", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("softmax_scale", ctypes.c_float),
        ("layout", ctypes.c_int32),
        ("sm_count", ctypes.c_int32),
        ("gathered", ctypes.c_void_p),  # across nodes: symmetric, else NULL
    ]
    _defaults_ = {"layout": TW_RING_ZIGZAG}


class AgGemmArgs(_Versioned):
    """tw_ag_gemm_args_t; ``AgGemmArgs()`` equals TW_AG_GEMM_ARGS_INIT."""

    _version_ = TW_AG_GEMM_ARGS_VERSION
    _defaults_ = {"comm_mode": 2}  # TW_AG_COMM_AUTO
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("c_dtype", c_enum),  # tw_dtype_t
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("a_gathered", ctypes.c_void_p),
        ("m_local", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("ldb", ctypes.c_int64),
        ("ldc", ctypes.c_int64),
        ("comm_sms", ctypes.c_int32),
        ("comm_mode", ctypes.c_int32),  # tw_ag_comm_mode_t
        ("no_gathered_out", ctypes.c_int32),  # version 2
        ("reserved", ctypes.c_int32),
    ]


class GemmRsArgs(_Versioned):
    """tw_gemm_rs_args_t (tw_gemm_rs and tw_gemm_ar); ``GemmRsArgs()`` equals
    TW_GEMM_RS_ARGS_INIT."""

    _version_ = TW_GEMM_RS_ARGS_VERSION
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("out_dtype", c_enum),  # tw_dtype_t
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("lda", ctypes.c_int64),
        ("ldb", ctypes.c_int64),
        ("ldo", ctypes.c_int64),
        ("reduce_sms", ctypes.c_int32),
        ("partials", ctypes.c_int32),
        ("out_symmetric", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class MoeArgs(_Versioned):
    """tw_moe_args_t (tw_moe_dispatch, tw_moe_combine, tw_moe_dispatch_gemm, tw_moe_gemm_combine,
    tw_moe_ffn); ``MoeArgs()`` equals TW_MOE_ARGS_INIT."""

    _version_ = TW_MOE_ARGS_VERSION
    _defaults_ = {"index_bits": 32}
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint32),
        ("index_bits", ctypes.c_int32),  # topk_idx's integers: 32 or 64
        ("x", ctypes.c_void_p),
        ("topk_idx", ctypes.c_void_p),
        ("topk_weights", ctypes.c_void_p),  # const float *
        ("recv", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),  # int32_t *, written by dispatch
        ("expert_out", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("tokens", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("n_out", ctypes.c_int64),
        ("experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("recv_rows", ctypes.c_int64),
        # tw_moe_dispatch_gemm: the local experts' weights; tw_moe_ffn: w13 [local][2 inter,
        # hidden], each expert's gate rows then its up rows
        ("weights", ctypes.c_void_p),
        # version 2 (absent before), tw_moe_ffn only:
        ("weights2", ctypes.c_void_p),  # w2 [local][hidden, inter]: the down projection
        ("h", ctypes.c_void_p),  # bf16 [recv_rows, 2 inter], this rank's memory: gate | up
        ("act", ctypes.c_void_p),  # bf16 [recv_rows, inter], this rank's memory: swiglu(h)
        ("inter", ctypes.c_int64),  # the experts' intermediate size, a multiple of 8
        # version 3 (absent before), tw_moe_combine_backward only:
        ("grad", ctypes.c_void_p),  # bf16 [tokens, n_out]: the gradient of the combine's out
        ("expert_grad", ctypes.c_void_p),  # symmetric bf16 [recv_rows, n_out], written
        ("weights_grad", ctypes.c_void_p),  # float * [tokens, top_k], written (NULL: not)
    ]


# ---- the next fused ops' argument structs go here as they land ----

# C typedef name -> ctypes struct, for the layout test.
STRUCTS = {
    "tw_unique_id_t": UniqueId,
    "tw_config_t": Config,
    "tw_gemm_args_t": GemmArgs,
    "tw_grouped_gemm_args_t": GroupedGemmArgs,
    "tw_attention_args_t": AttentionArgs,
    "tw_attention_backward_args_t": AttentionBackwardArgs,
    "tw_ring_attention_args_t": RingAttentionArgs,
    "tw_ring_attention_backward_args_t": RingAttentionBackwardArgs,
    "tw_ag_gemm_args_t": AgGemmArgs,
    "tw_gemm_rs_args_t": GemmRsArgs,
    "tw_moe_args_t": MoeArgs,
}

# ---- functions ----------------------------------------------------------------------------

_P = ctypes.POINTER
_int_p = _P(ctypes.c_int)
_char_pp = _P(ctypes.c_char_p)

# name -> (restype, argtypes), in header order. tw_status_t results are c_enum.
FUNCTIONS = {
    "tw_status_string": (ctypes.c_char_p, [c_enum]),
    "tw_last_error": (ctypes.c_char_p, []),
    "tw_version": (ctypes.c_int, []),
    "tw_transport_info": (c_enum, [ctypes.c_char_p, ctypes.c_size_t]),
    "tw_config_init": (c_enum, [_P(Config)]),
    # comm lifetime
    "tw_get_unique_id": (c_enum, [_P(UniqueId)]),
    "tw_comm_init_rank": (c_enum, [_P(tw_comm_t), ctypes.c_int, UniqueId, ctypes.c_int,
                                   _P(Config)]),
    "tw_comm_init_all": (c_enum, [_P(tw_comm_t), ctypes.c_int, _int_p, _P(Config)]),
    "tw_comm_destroy": (c_enum, [tw_comm_t]),
    # comm queries
    "tw_comm_rank": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_size": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_device": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_local_rank": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_local_size": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_node": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_nodes": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_sm_budget": (c_enum, [tw_comm_t, _int_p]),
    "tw_comm_last_error": (ctypes.c_char_p, [tw_comm_t]),
    "tw_comm_async_error": (c_enum, [tw_comm_t, _P(c_enum)]),
    # symmetric heap
    "tw_mem_alloc": (c_enum, [tw_comm_t, ctypes.c_size_t, _P(ctypes.c_void_p)]),
    "tw_mem_free": (c_enum, [tw_comm_t, ctypes.c_void_p]),
    "tw_mem_peer_ptrs": (c_enum, [tw_comm_t, ctypes.c_void_p, _P(ctypes.c_void_p)]),
    "tw_mem_peer_ptr": (c_enum, [tw_comm_t, ctypes.c_void_p, ctypes.c_int,
                                 _P(ctypes.c_void_p)]),
    # ops
    "tw_allgather": (c_enum, [tw_comm_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                              tw_stream_t]),
    "tw_barrier": (c_enum, [tw_comm_t, tw_stream_t]),
    "tw_gemm_args_init": (c_enum, [_P(GemmArgs)]),
    "tw_gemm": (c_enum, [_P(GemmArgs), tw_stream_t]),
    "tw_grouped_gemm_args_init": (c_enum, [_P(GroupedGemmArgs)]),
    "tw_grouped_gemm": (c_enum, [_P(GroupedGemmArgs), tw_stream_t]),
    "tw_grouped_gemm_wgrad_workspace_size": (c_enum, [ctypes.c_int64, ctypes.c_int64,
                                                      ctypes.c_int64, _P(ctypes.c_size_t)]),
    "tw_grouped_gemm_wgrad": (c_enum, [_P(GroupedGemmArgs), ctypes.c_void_p, ctypes.c_size_t,
                                       tw_stream_t]),
    "tw_attention_args_init": (c_enum, [_P(AttentionArgs)]),
    "tw_attention": (c_enum, [_P(AttentionArgs), tw_stream_t]),
    "tw_attention_backward_args_init": (c_enum, [_P(AttentionBackwardArgs)]),
    "tw_attention_backward": (c_enum, [_P(AttentionBackwardArgs), tw_stream_t]),
    "tw_ring_attention_args_init": (c_enum, [_P(RingAttentionArgs)]),
    "tw_ring_attention": (c_enum, [tw_comm_t, _P(RingAttentionArgs), tw_stream_t]),
    "tw_ring_attention_backward_args_init": (c_enum, [_P(RingAttentionBackwardArgs)]),
    "tw_ring_attention_backward_gathered_bytes": (c_enum, [tw_comm_t, ctypes.c_int64,
                                                           ctypes.c_int64, ctypes.c_int64,
                                                           ctypes.c_int64, ctypes.c_int64,
                                                           ctypes.POINTER(ctypes.c_size_t)]),
    "tw_ring_attention_backward": (c_enum, [tw_comm_t, _P(RingAttentionBackwardArgs),
                                            tw_stream_t]),
    # fused ops
    "tw_ag_gemm_args_init": (c_enum, [_P(AgGemmArgs)]),
    "tw_ag_gemm": (c_enum, [tw_comm_t, _P(AgGemmArgs), tw_stream_t]),
    "tw_gemm_rs_args_init": (c_enum, [_P(GemmRsArgs)]),
    "tw_gemm_rs_workspace_size": (c_enum, [tw_comm_t, ctypes.c_int64, ctypes.c_int64,
                                           _P(ctypes.c_size_t)]),
    "tw_gemm_rs": (c_enum, [tw_comm_t, _P(GemmRsArgs), tw_stream_t]),
    "tw_gemm_ar": (c_enum, [tw_comm_t, _P(GemmRsArgs), tw_stream_t]),
    "tw_moe_args_init": (c_enum, [_P(MoeArgs)]),
    "tw_moe_workspace_size": (c_enum, [tw_comm_t, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_int64, _P(ctypes.c_size_t)]),
    "tw_moe_dispatch": (c_enum, [tw_comm_t, _P(MoeArgs), tw_stream_t]),
    "tw_moe_combine": (c_enum, [tw_comm_t, _P(MoeArgs), tw_stream_t]),
    "tw_moe_dispatch_gemm": (c_enum, [tw_comm_t, _P(MoeArgs), tw_stream_t]),
    "tw_moe_gemm_combine": (c_enum, [tw_comm_t, _P(MoeArgs), tw_stream_t]),
    "tw_moe_ffn": (c_enum, [tw_comm_t, _P(MoeArgs), tw_stream_t]),
    "tw_moe_combine_backward": (c_enum, [tw_comm_t, _P(MoeArgs), tw_stream_t]),
    "tw_swiglu": (c_enum, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           tw_stream_t]),  # no comm: its first void * is h (_NO_COMM)
    # ---- add each new op's lines here when it lands in tilewire.h
    # environment knobs
    "tw_env_count": (ctypes.c_int, []),
    "tw_env_describe": (c_enum, [ctypes.c_int, _char_pp, _char_pp, _char_pp, _char_pp,
                                 _char_pp]),
}

# Functions whose first parameter is a `void *` that is not a comm (ctypes sees tw_comm_t and
# void * alike): call() reports their failures through tw_last_error() alone.
_NO_COMM = frozenset({"tw_swiglu"})

# ---- loading ------------------------------------------------------------------------------

LIBRARY_NAME = "libtilewire.so"
# The soname (CMake's SOVERSION is the major version): what binaries linked with -ltilewire
# look for, and the name the installed package carries the library under.
SONAME = "%s.%d" % (LIBRARY_NAME, TW_VERSION_MAJOR)
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_SOURCE_BUILD_DIR = _PACKAGE_DIR.parent.parent / "build"

_lock = threading.Lock()
_loaded = None  # the CDLL, once loaded
_loaded_path = None
_missing = ()  # header functions the loaded library lacks (an older build)


class LibraryNotFoundError(ImportError):
    """libtilewire.so could not be found or loaded."""


def candidate_paths():
    """Where the library is looked for, in order (existing or not)."""
    paths = []
    env = os.environ.get("TILEWIRE_LIB")
    if env:
        p = pathlib.Path(env).expanduser()
        paths.append(p / LIBRARY_NAME if p.is_dir() else p)
    paths.append(_PACKAGE_DIR / SONAME)
    paths.append(_PACKAGE_DIR / LIBRARY_NAME)
    paths.append(_SOURCE_BUILD_DIR / LIBRARY_NAME)
    return paths


def library_location():
    """The library in use without loading it: the loaded one, else the first existing path
    that lib() would try (None when there is none; the system search path is not asked)."""
    if _loaded_path is not None:
        return _loaded_path
    paths = candidate_paths()
    if os.environ.get("TILEWIRE_LIB"):  # lib() takes that one or none
        paths = paths[:1]
    for path in paths:
        if path.exists():
            return path
    return None


def _bind(cdll):
    missing = []
    for name, (restype, argtypes) in FUNCTIONS.items():
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    return tuple(missing)


def lib():
    """The loaded libtilewire (a ctypes.CDLL with every function's prototype set)."""
    global _loaded, _loaded_path, _missing
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        tried = []
        env_set = bool(os.environ.get("TILEWIRE_LIB"))
        for i, path in enumerate(candidate_paths()):
            if not path.exists():
                tried.append("%s (absent)" % path)
                if i == 0 and env_set:
                    raise LibraryNotFoundError(
                        "TILEWIRE_LIB=%s: no such file" % os.environ["TILEWIRE_LIB"]
                    )
                continue
            try:
                cdll = ctypes.CDLL(str(path))
            except OSError as e:
                tried.append("%s (%s)" % (path, e))
                if i == 0 and env_set:
                    raise LibraryNotFoundError("TILEWIRE_LIB=%s: %s" % (path, e)) from e
                continue
            _missing = _bind(cdll)
            _loaded_path = path
            _loaded = cdll
            return cdll
        system = ctypes.util.find_library("tilewire")
        if system:
            try:
                cdll = ctypes.CDLL(system)
            except OSError as e:
                tried.append("%s (%s)" % (system, e))
            else:
                _missing = _bind(cdll)
                _loaded_path = pathlib.Path(system)
                _loaded = cdll
                return cdll
        tried.append("the system library path (not found)")
        raise LibraryNotFoundError(
            "libtilewire.so not found. Build it (`make` or `cmake --build build --target "
            "tilewire` at the repository root), install the package (`pip install .`), or set "
            "TILEWIRE_LIB to its path. Looked at: " + "; ".join(tried)
        )


def library_path():
    """The path of the loaded library (loading it if needed)."""
    lib()
    return _loaded_path


def missing_functions():
    """Functions of tilewire.h that the loaded library does not export (empty when in step)."""
    lib()
    return _missing


def function(name):
    """The prototype-bound C function `name`."""
    cdll = lib()
    if name in _missing:
        raise NotImplementedError(
            "%s is not exported by %s: the library is older than this Python package; rebuild it"
            % (name, _loaded_path)
        )
    return getattr(cdll, name)


# ---- calling ------------------------------------------------------------------------------


def _text(raw):
    return raw.decode("utf-8", "replace") if raw else ""


def last_error(comm=None):
    """tw_comm_last_error(comm) when comm is given and it has a message, else tw_last_error()."""
    if comm:
        message = _text(function("tw_comm_last_error")(comm))
        if message:
            return message
    return _text(function("tw_last_error")())


def status_string(status):
    return _text(function("tw_status_string")(int(status)))


def check(status, name, comm=None):
    """Raises the error of a non-success status returned by function `name`."""
    if status != Status.SUCCESS:
        raise error_for(status, last_error(comm), name)


def call(name, *args, comm=None):
    """Calls tw function `name` (status-returning) and raises if it failed.

    `comm` is the handle whose tw_comm_last_error explains a failure; by default the first
    argument when the function takes a tw_comm_t first (not for _NO_COMM's functions); False:
    tw_last_error() only.
    """
    fn = function(name)
    if comm is None and fn.argtypes and fn.argtypes[0] is tw_comm_t and args \
            and name not in _NO_COMM:
        comm = args[0]
    status = fn(*args)
    check(status, name, comm)


def version():
    """TW_VERSION_CODE of the loaded library (MAJOR*10000 + MINOR*100 + PATCH)."""
    return int(function("tw_version")())


def transport_info():
    """What the inter-node transport finds on this host (tw_transport_info): rdma-core's version
    and the RDMA devices, one line each; where rdma-core is missing, the reason (ranks of one
    node are unaffected)."""
    buf = ctypes.create_string_buffer(8192)
    function("tw_transport_info")(buf, ctypes.sizeof(buf))
    return buf.value.decode("utf-8", "replace")


# Each versioned struct's C initialiser (fills it as its _INIT macro does).
INIT_FUNCTIONS = {
    "tw_config_t": "tw_config_init",
    "tw_gemm_args_t": "tw_gemm_args_init",
    "tw_grouped_gemm_args_t": "tw_grouped_gemm_args_init",
    "tw_attention_args_t": "tw_attention_args_init",
    "tw_attention_backward_args_t": "tw_attention_backward_args_init",
    "tw_ring_attention_args_t": "tw_ring_attention_args_init",
    "tw_ring_attention_backward_args_t": "tw_ring_attention_backward_args_init",
    "tw_ag_gemm_args_t": "tw_ag_gemm_args_init",
    "tw_gemm_rs_args_t": "tw_gemm_rs_args_init",
    "tw_moe_args_t": "tw_moe_args_init",
}


def c_init(struct_name):
    """A struct (e.g. "tw_config_t") filled by the library's own initialiser, for checking
    the Python constructors (which mirror the _INIT macros) against it."""
    cls = STRUCTS[struct_name]
    value = cls()
    ctypes.memset(ctypes.addressof(value), 0xFF, ctypes.sizeof(value))
    call(INIT_FUNCTIONS[struct_name], ctypes.byref(value))
    return value


def env_knobs():
    """Every TW_* environment knob: a list of dicts with name, type, default, current,
    description (tw_env_count / tw_env_describe)."""
    count = function("tw_env_count")()
    knobs = []
    for i in range(count):
        fields = [ctypes.c_char_p() for _ in range(5)]
        call("tw_env_describe", i, *[ctypes.byref(f) for f in fields])
        name, type_, default, current, description = (_text(f.value) for f in fields)
        knobs.append(
            {
                "name": name,
                "type": type_,
                "default": default,
                "current": current,
                "description": description,
            }
        )
    return knobs
