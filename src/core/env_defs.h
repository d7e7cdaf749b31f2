/*
 * Every TW_* environment knob, in one table:
 *   TW_ENV(name, type, default, class, alike, description)
 * type: int, size (bytes, K/M/G/T suffixes), bool (0 or 1) or str.
 * class: USER, a setting a user of the library may need (docs/ENV.md), or DEV, a developer
 *   switch: a tuning override of a plan's choice, a way for the tests and tw-bench to reach a
 *   path the plans take, or a debug aid (docs/ENV-DEV.md).
 * alike: 1 where every rank of a comm must give the knob the same value, because it changes
 *   how ranks number, store, fetch or agree on each other's data, or which kernel or plan runs
 *   where the peers must run the same one. tw_comm_init_rank compares these across the ranks
 *   (tw_check_alike_knobs, runtime/comm.c) and fails, naming the knob, where they differ.
 * description: the contract: what the knob does, its values and its default.
 * The code reads knobs through env.h; `tw-info` prints this table and generates both pages
 * (`tw-info --env-markdown`, `tw-info --env-dev-markdown`); tests/host/test_env.c checks the
 * files are current.
 */
TW_ENV(TW_LOG_LEVEL, int, "1", USER, 0,
       "Host log verbosity: 0 silent, 1 warnings, 2 info, 3 debug.")
TW_ENV(TW_SM_BUDGET, int, "0", USER, 0,
       "SMs each rank's kernels may occupy; 0 divides the device's SMs among the ranks sharing it. "
       "Overridden by tw_config.sm_budget when that is non-zero.")
TW_ENV(TW_RANKS_PER_NODE, int, "0", USER, 0,
       "0 groups ranks into nodes by host; N > 0 makes virtual nodes of N consecutive ranks (to "
       "run the inter-node path on one host). tw_config.ranks_per_node wins when non-zero.")
TW_ENV(TW_BOOTSTRAP_TIMEOUT_MS, int, "30000", USER, 0,
       "How long tw_comm_init_rank waits, in milliseconds, for every rank to arrive before failing "
       "with TW_ERR_TIMEOUT. tw_config.bootstrap_timeout_ms wins when non-zero.")
TW_ENV(TW_WAIT_TIMEOUT_MS, int, "10000", USER, 0,
       "Bound on every device-side spin-wait, in milliseconds; on expiry the kernel records {rank, "
       "op, flag, expected, seen} and aborts the comm (see tw_comm_async_error). "
       "tw_config.wait_timeout_ms wins when non-zero.")
TW_ENV(TW_WAIT_TRAP, bool, "0", DEV, 0,
       "1: a device wait that times out also executes `trap` (kills the CUDA context, useful under "
       "a debugger); 0: the kernel records the error and returns.")
TW_ENV(TW_HEAP_BYTES, size, "64G", USER, 0,
       "Virtual address space reserved per rank for the symmetric heap (physical memory is taken "
       "only by tw_mem_alloc). tw_config.heap_bytes wins when non-zero.")
TW_ENV(TW_BOOTSTRAP_ADDR, str, "", USER, 0,
       "IPv4 address the bootstrap root listens on and writes into the unique id; empty picks the "
       "first non-loopback interface, else 127.0.0.1.")
TW_ENV(TW_NET, str, "auto", USER, 0,
       "The transport to ranks on other nodes: auto (efa where this rank finds an EFA device, else "
       "ib), ib (libibverbs RC: ConnectX, RoCE or InfiniBand), efa (SRD through efadv), or none "
       "(a comm with ranks on other nodes then fails tw_comm_init). Unused within one node. Rail "
       "peers must end up on one backend, or tw_comm_init fails naming both.")
TW_ENV(TW_NET_DEVICES, str, "", USER, 0,
       "Comma-separated RDMA device names this rank may use (e.g. mlx5_0,mlx5_3); empty picks by "
       "PCIe distance to the rank's GPU, then by local rank.")
TW_ENV(TW_NET_QPS, int, "2", USER, 1,
       "Queue pairs per peer on other nodes (1 to 8); a flag's writes always take the one QP its "
       "index maps to, so they land in order.")
TW_ENV(TW_IBVERBS_LIB, str, "libibverbs.so.1", USER, 0,
       "The libibverbs the inter-node backends load (a name dlopen searches, or a path).")
TW_ENV(TW_EFADV_LIB, str, "libefa.so.1", USER, 0,
       "The libefa (efadv) the efa backend loads (a name dlopen searches, or a path); where the "
       "library TW_IBVERBS_LIB names carries efadv itself, that one is used.")
TW_ENV(TW_AG_CHUNK_BYTES, size, "0", DEV, 1,
       "AllGather chunk size in bytes (each chunk has its own flag); 0 lets the heuristic choose.")
TW_ENV(
    TW_AG_GROUP_M, int, "0", DEV, 0,
    "Row blocks per L2 group in tw_ag_gemm's rank-rotated tile order; 0 lets the heuristic choose.")
TW_ENV(TW_RS_REDUCE_CTAS, int, "-1", DEV, 0,
       "CTAs of tw_gemm_rs / tw_gemm_ar that start on the reduction (args.reduce_sms wins when "
       "non-zero); 0 lets every CTA run the GEMM first and reduce after its tiles; -1 lets the "
       "plan choose. Ranks may differ.")
TW_ENV(TW_RS_FUSED_W1, bool, "0", DEV, 0,
       "1 runs tw_gemm_rs / tw_gemm_ar at world 1 through the fused kernel (partials into the own "
       "staging, counted, reduced) instead of the plain GEMM, so that its GEMM phase can be "
       "profiled under a kernel-replaying profiler such as ncu, which a multi-rank call cannot "
       "survive; needs a workspace. 0: world 1 is the plain GEMM.")
TW_ENV(TW_RS_BAND, int, "0", DEV, 1,
       "Column blocks per band of tw_gemm_rs / tw_gemm_ar's tile order (A is read once per band); "
       "0 lets the heuristic choose.")
TW_ENV(TW_RS_GROUP_UNITS, int, "0", DEV, 1,
       "tw_gemm_rs / tw_gemm_ar put this many units (an owner's part of one tile) behind one flag, "
       "so each reduce and gather work item covers that many (at least what the flag slice needs); "
       "0 lets the plan choose (across nodes: groups of at least 1 MiB of fp32 partials, one RDMA "
       "write each).")
TW_ENV(TW_RS_BLOCK_N, int, "0", DEV, 1,
       "tw_gemm_rs / tw_gemm_ar: the fused GEMM's tile width, 128, 192 or 256 columns; any other "
       "value lets the plan choose (128 where 128 x 256 tiles would leave a last wave of CTAs "
       "mostly idle, as tw_gemm chooses, except where ranks share a GPU; else 256). 192 runs the "
       "ping-pong loop (each tile one consumer warpgroup's, its epilogue under the other's "
       "mainloop; no owner epilogue).")
TW_ENV(TW_RS_INTERLEAVE, int, "-1", DEV, 1,
       "tw_gemm_rs / tw_gemm_ar with m / world a multiple of 128: 1 interleaves the owners' row "
       "blocks in each band sweep (every world consecutive tiles go to world owners, so stores to "
       "peers spread over the whole GEMM), 0 sweeps one owner's rows after another, -1 lets the "
       "plan choose (interleaved with fp32 partials on distinct GPUs).")
TW_ENV(TW_AG_PEER_GATHER, int, "-1", DEV, 1,
       "tw_ag_gemm with the gathered output where every rank shares one GPU (shards of whole "
       "128-row blocks): 1 lets the GEMM read the peers' shards in place, as with no_gathered_out, "
       "and the tiles of column block 0 store each A box they load into a_gathered (write-through: "
       "no copy CTAs, no second read); 2 the write-through with every tile of a row block storing "
       "its share of the k-blocks; 0 pushes the shards and the GEMM waits for them; -1 lets the "
       "plan choose (1 where N per rank <= 4096, else 0).")
TW_ENV(TW_AG_AUTO_CE, int, "-1", DEV, 1,
       "tw_ag_gemm with comm_mode TW_AG_COMM_AUTO (the default), ranks on GPUs of their own, not "
       "under graph capture: 1 always moves the shards by copy engine, 0 never, -1 lets the plan "
       "choose (2 ranks, one process or one per GPU, where the push takes 0.3-0.8 of the GEMM's "
       "estimated time).")
TW_ENV(TW_AG_OWN_COPY_CE, int, "-1", DEV, 0,
       "tw_ag_gemm (SM mode, not in place, shards of whole 128-row blocks): 1 copies the rank's "
       "own shard into a_gathered with a copy engine beside the kernel, 0 with the kernel's "
       "communication CTAs after their pushes, -1 lets the plan choose (the copy engine on 2 ranks "
       "on GPUs of their own where the push is under 0.3 of the GEMM's estimated time).")
TW_ENV(TW_AG_UNFUSED_SMALL, bool, "1", DEV, 1,
       "tw_ag_gemm: 1 runs tw_allgather then tw_gemm with K split over CTAs where the GEMM has few "
       "tiles over a long K (where tw_gemm's split_k -1 would split it: decode shapes), 0 always "
       "the fused kernel. Same bits.")
TW_ENV(TW_AG_VARIANT, int, "-1", DEV, 0,
       "tw_ag_gemm kernel variant: 1 the plain GEMM's 3-stage / 32 KiB epilogue split, 0 the "
       "op's own (4 stages at 128 x 256); -1 lets the plan choose (1 where ranks share a GPU). "
       "Same bits.")
TW_ENV(TW_AR_PUSH, int, "-1", DEV, 1,
       "tw_gemm_ar: 1 has each owner's reduction store its reduced rows into every other rank's "
       "workspace, where the workspace holds tw_gemm_rs_workspace_size() bytes; 0 has every rank "
       "load them from the owner; -1 lets the plan choose (the push where no two ranks of the comm "
       "share a GPU). Same bits.")
TW_ENV(TW_AR_PEER_OUT, int, "-1", DEV, 1,
       "tw_gemm_ar into a plain out (out_symmetric 0) where every rank of the comm lives in one "
       "process on one GPU: -1 has the unfused pipeline's reduce kernel store each rank's reduced "
       "rows straight into every rank's out (their addresses exchanged at entry) instead of into a "
       "gather area that each rank then copies, and lets TW_RS_UNFUSED_SMALL's rule treat such "
       "outs as symmetric; 0 never. Same bits.")
TW_ENV(TW_AR_DIRECT, int, "-1", DEV, 1,
       "tw_gemm_ar's direct scheme (every rank stores each partial tile into every rank's staging "
       "and reduces all rows itself), where the workspace holds world x m x n partials: 1 wherever "
       "it fits, 0 never, -1 lets the plan choose (2 ranks on distinct GPUs: bf16 partials at m <= "
       "4096 with K >= 4096, either partials at m < 128). Same bits.")
TW_ENV(TW_RS_UNFUSED_SMALL, int, "-1", DEV, 1,
       "tw_gemm_rs / tw_gemm_ar: 1 runs the unfused pipeline in the call (tw_gemm of the whole "
       "partial into the workspace, then one reduce kernel that waits for every rank's partial, "
       "sums its rows in rank order and, for tw_gemm_ar, stores them into every rank's output) "
       "wherever the workspace holds it, 0 always the fused kernel, -1 lets the plan choose "
       "(decode shapes: on ranks that do not share a GPU tw_gemm_rs at m <= 512 and tw_gemm_ar at "
       "m <= 256; where ranks share one tw_gemm_ar at m <= 64, tw_gemm_ar into symmetric outputs "
       "at m <= 4096 with K per rank <= 2048, and with fp32 partials tw_gemm_rs and tw_gemm_ar "
       "into symmetric outputs at m >= 4096 with K per rank <= 2048; plain outs count as symmetric "
       "where TW_AR_PEER_OUT applies). Across nodes 1 runs tw_gemm, then the rail kernel's "
       "reduce of the copied partial; anything else the fused rail kernel. Same bits.")
TW_ENV(TW_RS_UNFUSED_LL, int, "-1", DEV, 1,
       "tw_gemm_rs / tw_gemm_ar's unfused pipeline: 1 exchanges the rows in the comm's low-latency "
       "area where the call's rows fit (TW_LL_BYTES): each rank stores its peers' rows of its "
       "partial into their area as 16-byte words that carry the call's flag with the data (no "
       "handshake, fence or remote load on the path); 0 the pull (an entry handshake, the owners "
       "load the peers' partials, a release at the end); -1 lets the plan choose (the area where a "
       "rank's words for one peer are at most 1 MiB, 2 MiB at m <= 128 where the swap-AB GEMM "
       "stores them; where ranks share a GPU and tw_gemm_ar's rows go straight into every rank's "
       "out, only bf16 partials at m <= 64). Same bits.")
TW_ENV(TW_RS_LL_REDUCE, int, "-1", DEV, 0,
       "tw_gemm_rs where the swap-AB GEMM's epilogue stores the low-latency words: 1 has that "
       "epilogue also sum this rank's own rows (it stores the peers' rows, waits for the peers' "
       "words of its own, adds in rank order and writes out), so that own rows never travel as "
       "words and the reduce kernel after it keeps the call's books on one CTA; 0 leaves the sums "
       "to the reduce kernel; -1 lets the plan choose (1 at m <= 16). Same bits; ranks may differ.")
TW_ENV(TW_AG_LL, int, "-1", DEV, 1,
       "tw_allgather (and tw_ag_gemm's decode path through it): 1 exchanges the shards through the "
       "comm's low-latency area where they fit (TW_LL_BYTES): each rank stores its shard into "
       "every peer's area as 16-byte words carrying the call's flag, and each copies the words "
       "into its recv; 0 never (the SM push: entry handshake, copies, fenced flags); -1 lets the "
       "plan choose (the area on ranks that do not share a GPU for at most 512 KiB per rank).")
TW_ENV(TW_LL_BYTES, size, "16M", USER, 1,
       "Bytes of each rank's low-latency area (in its symmetric heap, taken at init): where "
       "tw_allgather and the unfused decode pipeline of tw_gemm_rs / tw_gemm_ar exchange data with "
       "flags in the data (TW_AG_LL, TW_RS_UNFUSED_LL), and the MoE dispatches exchange their "
       "counts inside a node (across nodes too, where only the rail hop is an RDMA write). A call "
       "that needs more (for tw_gemm_rs 2 x "
       "world x m/world x n x partial bytes x 2, plus m x n x 4 for tw_gemm_ar) takes the path "
       "without it. 0: no area.")
TW_ENV(
    TW_RS_PULL, int, "-1", DEV, 1,
    "tw_gemm_rs / tw_gemm_ar: 1 has each rank store its whole partial locally and the owners read "
    "their rows of it from every rank when reducing (the pull), 0 has the epilogue push each tile "
    "into its owner's staging (the push), -1 lets the plan choose (the pull where more than 2 "
    "ranks of the comm share a GPU, or where m / world is not a multiple of 64). Same bits.")
TW_ENV(
    TW_RS_OWNER_EPI, int, "-1", DEV, 1,
    "tw_gemm_rs / tw_gemm_ar on 2 ranks (m / 2 a multiple of 128, one unit per flag, the push): 1 "
    "computes each rank's own tiles after the peer's partials of them have landed and reduces them "
    "in the tile's epilogue (no own partial stored or re-read, no reduce CTA; tw_gemm_ar's own "
    "tile also stores its reduced rows for the peer and sets its ready flag), 0 never, -1 lets the "
    "plan choose (fp32 partials, K per rank < 4096 and at least 3 waves of tiles; for tw_gemm_rs "
    "not where args.reduce_sms or TW_RS_REDUCE_CTAS sets the reduce CTAs). Same bits.")
TW_ENV(
    TW_GEMM_SWAP, int, "-1", DEV, 0,
    "tw_gemm (and the unfused pipeline of tw_gemm_rs / tw_gemm_ar through it) at m <= 64: 1 "
    "computes C^T = B A^T on tiles of 128 of B's rows x 16 (m <= 16) or 64 of A's rows, so no "
    "wgmma row is spent past m, and stores C transposed; 2 the same on tiles of 64 of B's rows "
    "(twice the CTAs; unsplit only; 32 of A's rows wide at 16 < m <= 32); 0 keeps 128-row tiles; "
    "-1 lets the plan choose (the swap on 64-row tiles where unsplit 128-row tiles would fill at "
    "most half the SMs; the unfused pipeline of tw_gemm_rs / tw_gemm_ar up to m 128 on GPUs of "
    "their own). 1 and 2 also reach m <= 128 (64-wide tiles of A's rows, two at m 128). Same bits.")
TW_ENV(TW_FAULT_STALL_TILE, int, "-1", DEV, 0,
       "For tests: the GEMM core's producer never loads the first stage of this tile (its index in "
       "the call's tile order, in every GEMM-core kernel of the process) and the pipeline's waits "
       "give up after 500 ms, so an internal stall must be reported (fused ops: "
       "tw_comm_async_error) or trap the kernel (tw_gemm), never hang. -1: off.")
TW_ENV(TW_TRACE, bool, "0", USER, 0,
       "1: every fused kernel records per-CTA phase times and wait totals, and one line per call "
       "and rank goes to stderr when the call completes (costs a copy and a host callback per "
       "call). 0: off.")
TW_ENV(TW_WATCHDOG_S, int, "0", USER, 0,
       "N > 0: a host thread reports on stderr a tilewire call that has not finished N seconds "
       "after the one before it did: per CTA the bounded wait it spins in (channel, peer, item), "
       "the last GEMM tile its producer claimed and its consumers finished, and when. Puts the "
       "TW_TRACE rows in host-mapped memory (per-call lines only with TW_TRACE=1). 0: off.")
TW_ENV(TW_AG_COMM_SMS, int, "0", DEV, 0,
       "SMs given to communication in tw_allgather and tw_ag_gemm; 0 lets the heuristic choose.")
