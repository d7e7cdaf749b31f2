#!/usr/bin/env bash
# The open questions of docs/PERF.md as one short device run (about 5 minutes; more if the
# hang comes back):
#   scripts/gpu-experiments.sh            logs under $OUT (default ./gpu-experiments-out),
#                                         bundled into experiments.tgz, a summary printed last
#   TW_BUILD_DIR=build-dev                where tw-bench and libtilewire.so are (default build)
#   TW_DIAG_LIBS="1 2 4 8 16 32"          measurement builds of libtilewire.so in
#                                         $TW_BUILD_DIR/diagN/ (-DTW_RS_DIAG=N, gemm_rs_sm90.cu;
#                                         scripts/diag-lib.sh makes one in half a minute); a name
#                                         varNAME (diagvarNAME/) is a build-time variant: tested
#                                         with test_gemm_rs and timed with the checks on
# Killed by a signal, it still bundles what it has and prints the summary so far.
#   TW_DIAG_VRANKS=0                      the measurement builds on 2 GPUs only (not 8 vranks)
#   TW_EXP="groups"                       which groups run, in order (functions exp_NAME below;
#                                         none: only the TW_DIAG_LIBS runs):
#     hang    four 8-rank gemm_ar sweeps under the watchdog, the interleaved test_gemm_rs twice
#             (the fifth session's stall; clean in the sixth)
#     ab      the fifth session's defaults against what they replaced (taken, sixth session)
#     flux    Flux's shape on 2 GPUs: the unfused bf16 pipeline as a fallback candidate,
#             interleaved owners and the reduce-CTA count with bf16 partials
#     vranks  8 virtual ranks: the reduce-CTA count where RS/AR trail the unfused pipeline
#     bands   8 virtual ranks: band widths 1, 2, 4 (operand traffic of the tile order)
#     push    tw_gemm_ar's push gather: test_gemm_rs on both placements, then the sweeps
#     r0      no reduce CTAs at the start (TW_RS_REDUCE_CTAS=0) against the plan's count
#             (seventh session: taken where ranks share a GPU)
#     w1      the fused GEMM phase alone (world 1 through the fused kernel) against tw_gemm,
#             timed and under ncu
#     wt      8 virtual ranks: the write-through gather (TW_AG_PEER_GATHER=1) against the push,
#             in both A/B orders (taken at N <= 4096, seventh session)
#     wt2     the spread write-through (TW_AG_PEER_GATHER=2) against 0 and 1 (eighth session:
#             an option, not a default)
#     tr8     TW_TRACE of GEMM+RS / GEMM+AR on 8 virtual ranks: GEMM phase, reduction, starts
#     graph   eager calls with the host's enqueue time against CUDA-graph replays (8 vranks)
#     tails   SM clock and power while the fused ag_gemm runs at flux-tp8 (8 vranks): its tails
#     ce      test_mp with the copy-engine mode on 2 GPUs, one process per GPU (passed, ninth
#             session); the copy engine's host enqueue time and both bench methods at M=16384
#     groups  TW_RS_GROUP_UNITS=0,2,4,8 in A/B: coarser reduce and gather work items for
#             GEMM+RS / GEMM+AR, on 8 virtual ranks and on 2 GPUs (tenth session: taken for
#             GEMM+AR's gather, up to 4 units while 2 groups per CTA remain)
#     g10     the plan's gather groups against single units, GEMM+AR (taken, tenth session)
#     sym     symmetric outputs with TW_RS_GROUP_UNITS=1,2,4 (taken, tenth session)
#     push10  the push gather against the pull with coarser groups, GEMM+AR
#     diag9   TW_TRACE of 8-rank GEMM+RS / GEMM+AR at M=8192 (where the fused
#             all-gather half loses 0.3-0.5 ms); the copy-engine mode at M=16384 in three
#             processes and traced (its run-to-run spread, 1.65-1.80 ms)
#     oe12    GEMM+RS with own tiles reduced in their epilogue (TW_RS_OWNER_EPI), tests then
#             A/B on 2 GPUs and 2 virtual ranks (twelfth session: taken for fp32, K < 4096)
#     oe12d   the owner-epilogue rule: A/B of the rule (-1) against 0 and 1 on
#             2 GPUs; the plans it makes (TW_LOG_LEVEL=3)
#     next17  (run in the seventeenth session) 2 GPUs: decode-sized
#             shapes (M 16-256, against NCCL + cuBLAS: issue 7's "never slower at any shape"),
#             one process and one per GPU; the trace of GEMM+AR at M=64 (the latency floor);
#             bench_dist --profile (torch.profiler's kernel timeline) at M=64 and flux-tp8;
#             bench_dist's ag_gemm with the shard in place and TW_AG_OWN_COPY_CE=0,1 at
#             flux-tp8 and M=16384 (one process per GPU loses ~6% at flux-tp8)
#     s19     (nineteenth session, run) decode shapes' GPU time: tw-bench gemm under
#             TW_BENCH_GRAPH=1 (split rows), the fused ops from graphs on 2 GPUs, traces at M=64
#     s19b    (nineteenth session, run) split-K with TW_SPLIT_SCATTER=1: test_gemm,
#             split rows
#     s19m    memcheck of test_gemm (its scatter cases), about 400 s
#     s19c    the unfused pipeline in tw_gemm_rs / tw_gemm_ar (decode): tests, A/B, graphs
#     s19d    the same after its fp32 loads were made contiguous: test_gemm_rs, A/B, graphs
#     s19e    the rule taken from them: tests on both placements, A/B, bench_dist graphs
#     s20     (twentieth session; the group lives on exp/next20 at 9ee4092) 128 x 64 tiles
#             (TW_GEMM_N64), the unfused pipeline's release wait in the GEMM against its own
#             kernel, the push protocol (TW_RS_UNFUSED_PUSH): tests, gemm rows, A/B, graphs
#     s21     (twentieth session) main after ReleasedWait's merge: the unfused pipeline's tests on
#             both placements, test_mp, memcheck of test_gemm_rs --small, the wait A/B from graphs
#     s22     (twenty-first session, run and merged) swap-AB decode tiles (TW_GEMM_SWAP): test_gemm,
#             test_ag_gemm and test_gemm_rs (the bits across the ops), the gemm rows from
#             graphs and eager, the ops in A/B, bench_dist graphs, ncu of the decode GEMM;
#             the decode pipeline's reduce kernel by programmatic dependent launch in A/B
#     s24     (branch exp/swap64, not run) swap-AB on 64-row tiles: test_gemm (bits against
#             the 128-row tiles, both swap heights forced), test_ag_gemm, test_gemm_rs, gemm
#             rows from graphs, ncu at M=16, memcheck of test_gemm --small; 2 GPUs: bench_dist
#     s23     (branch exp/ll, not run) the unfused decode pipeline through the low-latency area
#             (TW_RS_UNFUSED_LL): its tests on both placements, A/B against the pull from graphs
#             and eager
#     s25     (branch exp/next22, run and merged) s23 and s24 trimmed into one 2-GPU call
#     s29     (branch exp/next25, run and merged) split-K through a workspace (tw_gemm_args_t.workspace,
#             TW_AG_GEMM_WS): the cluster tree's slices as single CTAs on tiles of 64 B rows:
#             tests (bitwise the tree), memcheck, tw_gemm's rows from graphs, tw_ag_gemm's
#             decode path in A/B from graphs (alternating) and eager
#     s30     (twenty-third session) eager decode one process per GPU, fast lane off / on;
#             torch.profiler's kernel times at flux-tp8 (GEMM+RS, GEMM+AR)
#     s97     (thirty-fifth session, merged) the consumers' 32-bit descriptor words: tests,
#             tw_gemm against main's library (diagold/) from graphs
#     s106-s110 (thirty-sixth and thirty-seventh sessions) live on their branches: s106 / s107
#             exp/noswap-half (ran), s108 exp/pad-probe, s109 exp/lean-producer2 and s110
#             exp/pair-lean (prepared): copy the branch's script in
#     s105    (thirty-sixth session; ran in the thirty-seventh: every pair mode ran alike, no DRAM-
#             miss multicast cost) scripts/probes/probe_multicast.cu (build it into
#             $TW_BUILD_DIR first: its header): whether a TMA multicast of lines that miss to
#             DRAM runs slower than one of L2 hits (exp/pair-a multicast the weights and ran at
#             half cuBLAS's rate, which multicasts the tokens), loads only, 5 modes
#     s101    (thirty-fifth session, merged) swap-AB's 64-row tiles 32 of A's rows wide at m <= 32
#             (tw_gemm_swap_half_mt): tw_gemm against ff8573b (diagold/), the decode pipelines
#     s100    (thirty-fifth session, merged) one consumer warpgroup on swap-AB's 64-row tiles
#             (m64n(2 BN)k16): tests, tw_gemm against a6dfbfc (diagold/), the decode pipelines
#     s96     (thirty-fourth session) tw_gemm with the producer's lean per-stage loop against
#             the old library (diagold/), decode and large shapes, from graphs
#     s94     (thirty-third session, prepared) the decode GEMM core against cuBLAS's kernel at M=128
#             N=4096 K=4096 under ncu (where each one's warps stall, by source line), and the
#             8-virtual-rank decode GEMM+AR call traced (0.146 ms against its kernels apart 0.087)
#             (s93: branch exp/pp-owner)
#     s92     (thirty-second session) the 192-column rule for tw_gemm_ar's direct scheme
#     s91     (thirty-second session) flux-tp8 on the 192-column tiles: reduce CTAs, bands; K 4096
#     s90     (thirty-second session) the ping-pong loop in tw_gemm_rs / tw_gemm_ar
#             (TW_RS_BLOCK_N=192): test_gemm_rs on both placements, A/B on 2 GPUs
#     s89     (thirty-second session) ping-pong consumers: test_gemm, the plain GEMM's variant rows
#     s88     (thirty-second session) ll_sum_item, the one wait-unpack-sum over the peers' words:
#             test_gemm_rs on both placements, the decode rows against the old library
#     s87     (thirty-first session, prepared, not run) whether tw_gemm's own swap rule should reach
#             m 128 too (one shape measured, s85): tw_gemm at M=96 / 128 over N and K from graphs
#             with the forced swap rows; tw_ag_gemm's decode path at M=128 swapped; 8 virtual
#             ranks' GEMM+AR at M=128 (where ranks share a GPU the pipeline keeps 64)
#     s86     (thirty-first session) the pipeline's swap rule to m 128 (tw_gemm_rs_swap_max_m) and
#             the area's 2 MiB there: test_gemm_rs on both placements, its memcheck, and the
#             decode rows at M=128 / 64 one process per GPU from graphs
#     s85     (thirty-first session) swap-AB forced past m 64 (TW_GEMM_SWAP=1/2 reach m 128): the
#             tests (bits against 128-row tiles; tw_gemm_rs's decode pipeline through it), tw_gemm
#             at M=96 / 128 from graphs, and GEMM+RS / GEMM+AR at M=128 one process per GPU (NCCL
#             bf16 + torch 0.0208 ms against 0.0232 with bf16 partials in s83)
#     s84     (thirty-first session, 144a152) the decode rows on the head: one process per GPU
#             from graphs (bench_dist) and one process driving both (graphs of 10 calls a fork)
#     s83     (thirty-first session) where the area beats the pull now (its rules were measured
#             with the old layout): tw-llbench on the library's functions; bench_dist from graphs
#             at m 128 / 256 with TW_RS_UNFUSED_LL=1,-1 alternated; tw_ag_gemm's decode path at
#             m 128 / 256 with TW_AG_LL=-1,1 (1-2 MiB shards)
#     s82     (thirty-first session) the words' line layout (tw_ll_item_off) in every user of the
#             area: tests on both placements and memchecks, then one process per GPU from graphs
#             against HEAD~'s library (diagold/, alternated) at the decode shapes, and the two
#             rules it may move (TW_RS_LL_REDUCE at m 64, the area against the pull for fp32 m 64)
#     s81     (thirty-first session) tw-llbench: the low-latency words' layout (ll32, one 128-byte
#             line per 8 items' words, plain stores + a flag a CTA) in ping-pong between the GPUs
#             at the decode payloads (512 KiB a way: GEMM+RS bf16 partials m 64; 128 KiB: m 16)
#     s80     (thirtieth session, prepared, not run) test_stall on both placements: b29e598's
#             case (tw_gemm_rs at m 16 with TW_RS_LL_REDUCE=1, peer absent) has not run on a GPU
#     s79     (thirtieth session, TW_RS_LL_REDUCE) tw_gemm_rs's own rows summed in the swap-AB
#             GEMM's low-latency epilogue (the reduce kernel keeps only the books): tests, then
#             A/B at decode on 2 GPUs (eager, graphs of 10 calls a fork), one process per GPU
#             alternated, and 8 virtual ranks
#     s78     (thirtieth session, 2 GPUs) decode from graphs, one process driving both GPUs,
#             with 10 calls a rank between the bench's cross-GPU fork and join
#             (TW_BENCH_BLOCK=10): s73's 0.85x paid that fork / join on every call
#     s77     (thirtieth session, 15c1348: swap-AB CTA pairs, TW_GEMM_SWAP_PAIR, dropped: 11-23%
#             slower) tests (test_gemm, test_gemm_rs on both placements, memcheck); tw_gemm at
#             decode shapes from graphs with the pair row; the decode pipelines A/B from graphs
#             and one process per GPU; unfused_reduce_kernel's one store loop against afce89a's
#             two (diagold/)
#     s76     (twenty-ninth session, main + TW_RS_UNFUSED_CTAS as a count, dropped) 8 virtual
#             ranks: the in-call reduce kernel on 16-128 CTAs a rank (s75: fewer was slower);
#             its test timed out (1024 spinning CTAs on 132 SMs) and used up the device time
#     s75     (twenty-ninth session, main + TW_RS_UNFUSED_CTAS, the knob dropped) 8 virtual
#             ranks, the --quick GEMM+AR from graphs with the in-call reduce kernel capped at
#             1-8 CTAs (s67's reading: its waiting CTAs hold SMs the later ranks' GEMMs need)
#     s74     (twenty-ninth session, c6bcbf1, 2 GPUs) decode from graphs, one process per GPU
#             (bench_dist --graph 10) at M=16 and 64, twice: s73's one-process rows put the
#             bf16 partials' GEMM+AR behind NCCL bf16
#     s73     (twenty-ninth session, c6bcbf1, 2 GPUs) decode GEMM+AR with bf16 partials: the
#             call against separate calls from graphs; the low-latency knobs interleaved
#     s72     (twenty-ninth session, c6bcbf1) tw_ag_gemm at world 1 against the GEMM alone in 5
#             interleaved rounds (issue 4's world-1 target; the suite read 1.03 at M=4096 N=512)
#     s71     (twenty-ninth session, c6bcbf1, 2 GPUs) decode M=64 GEMM+AR / GEMM+RS in 5
#             interleaved rounds of 40 (the suite's bf16p-outsym decode row: 0.0551 ms, 88% spread)
#     s70     (twenty-ninth session, c6bcbf1) 8 virtual ranks without work stealing
#             (TW_RS_STEAL=0): the bf16p rows against f106895's gemm_rs_sm90.cu (diagold/)
#     s69     (twenty-ninth session, main) 8 virtual ranks at M=16384: tw_ag_gemm with the
#             gathered output in 5 interleaved rounds, four runs (issue 4's last target)
#     s68     (twenty-ninth session, main + one item-position helper in reduce_unit and
#             gather_unit) test_gemm_rs; A/B against f106895's gemm_rs_sm90.cu (diagold/),
#             alternated, at flux-tp8 and M=16384 on 2 GPUs (the bf16p rows take the changed
#             division path)
#     s67     (twenty-ninth session) the in-call unfused pipeline's extra ~25 us at
#             M=1024 on 8 virtual ranks: TW_TRACE, nsys where present
#     s66     (twenty-eighth session, 6ae862e) the low-latency area against stores into every
#             rank's out for tw_gemm_ar on 8 virtual ranks (M=1024, decode M=64); tests
#     s65     (twenty-eighth session, c02cf34) the shared-GPU rule for tw_gemm_ar at m <= 4096:
#             tests and the --quick rows
#     s64     (twenty-eighth session) 8 virtual ranks between decode and m 4096: the rule
#             against the unfused pipeline in the call; two memchecks
#     s63     (twenty-eighth session) 8 virtual ranks at M=16384 in 5 interleaved rounds (the
#             overlap's spread)
#     s62     (twenty-eighth session, 2 GPUs) reduce-CTA counts for bf16 partials, interleaved
#     s61     (twenty-eighth session, 2 GPUs) s60's slow bf16p row, not reproduced
#     s60     (twenty-eighth session, 2 GPUs) reduce-CTA counts for bf16 partials as extra rows
#     s59     (twenty-seventh session, exp/evict, dropped) the partials' TMA stores with an L2
#             evict-first policy (TW_RS_STORE_EVICT): tests, A/B at flux-tp8 and M=16384
#     s58     (twenty-seventh session, main, 2 GPUs) SM clock and power per variant at
#             flux-tp8, GEMM+RS and GEMM+AR
#     s57     (twenty-seventh session, main) 8 virtual ranks at M=16384: tw_ag_gemm's
#             communication CTA count; GEMM+AR / GEMM+RS repeated for the overlap's spread
#     s56     (twenty-seventh session, main) the short-K rule to K 2048 against the fused
#             kernel on 8 virtual ranks at M=16384
#     s55     (twenty-seventh session, main) the in-call unfused pipeline against the fused
#             kernel on 8 virtual ranks at M=16384 K 2048 and flux-tp8; memcheck test_gemm_rs
#     s54     (twenty-sixth session; run in the twenty-seventh, the patch dropped) bf16 partials'
#             reduction with 8 items in flight a thread (TW_RS_BF16_DEEP): tests, A/B and traces
#             at flux-tp8 on 2 GPUs, M=16384
#     s53     (twenty-sixth session; run and merged in the twenty-seventh) tw_gemm_ar into plain
#             outs on virtual ranks through the peers' outs (TW_AR_PEER_OUT): tests, A/B on 8
#             virtual ranks at M=4096 / 8192, and the unfused pipeline at M=16384
#     s52     (twenty-sixth session, main with the short-K rule for ranks sharing a GPU) the
#             rule against the fused kernel on 8 virtual ranks, M=4096 K 512 and M=8192 K 1024
#     s51     (twenty-sixth session, main) the in-call unfused pipeline (TW_RS_UNFUSED_SMALL=1)
#             against the fused kernel on 8 virtual ranks at M=4096 K 512 and M=8192 K 1024
#     s50     (twenty-sixth session, removed: main and a -DTW_RS_LOAD_NOALLOC=1 build) the
#             partials' loads with L1::no_allocate: tw-rbench's load rows, tests, builds
#             alternated on 8 virtual ranks (M=4096 K 512) and on 2 GPUs (flux-tp8, M=16384)
#     s49     (twenty-sixth session, main) flux-tp8 GEMM+RS on 2 GPUs: traces and times with one
#             fork/join per call and per 8 calls (TW_BENCH_BLOCK); the reduce-CTA count 4 / 8 / 0
#     s48     (twenty-fifth session, removed: docs/patches/rs-reduce-tma.patch applied; run in the
#             twenty-sixth) the reduce CTAs' partials by 2-D TMA boxes (TW_RS_REDUCE_TMA) and
#             tw-rbench's carveout row: tests on both placements, counts and A/B on 2 virtual
#             ranks (4 reduce CTAs), A/B at flux-tp8 and M=16384 on 2 GPUs, traces
#     s47     (twenty-fifth session, exp/next34's build, run; TW_RS_REDUCE_BY_WARP measured slower
#             and taken out, so its A/B rows need that build) s43 and the warp-granular A/B in one
#             call: tests on both placements, the walk's A/B at flux-tp8 both orders and traces,
#             the warp-granular groups' A/B and a trace, the walk at M=16384
#     s43     (twenty-fifth session, branch exp/next33) the reduction's item walk
#             (TW_RS_REDUCE_WALK): tests, A/B on 2 virtual ranks at flux-tp8 with 4 reduce CTAs
#             and traces with the counts, 8 virtual ranks; with 2 GPUs A/B at flux-tp8 both
#             orders, M=16384, traces
#     s42     (twenty-fifth session) main with TW_TRACE's reduce counts: test_gemm_rs on both
#             placements, traces at flux-tp8 with the plan's reduce CTAs and 8
#     s38-s41, s46, s48, s50 (twenty-fourth to twenty-sixth sessions; their functions removed:
#             the knobs and builds they measured, TW_RS_REDUCE_FASTIDX, TW_RS_REDUCE_BULK,
#             TW_RS_REDUCE_BY_WARP, TW_RS_REDUCE_TMA (docs/patches' rs-reduce-tma.patch) and
#             -DTW_RS_LOAD_NOALLOC, are in no build on main; designs and figures in docs/PERF.md)
#     s37     (twenty-fourth session, on exp/next30 before the trace counters) 12 partial loads
#             in flight per reducing thread (TW_RS_REDUCE_LOADS): test_gemm_rs on both
#             placements, A/B at flux-tp8 and M=16384 (GEMM+RS, GEMM+AR), a trace, and 8
#             virtual ranks. Level or slower; the knob was taken out: its A/B rows need that
#             build
#     s36     (twenty-fourth session, on exp/next29 f63c5ec) the reduce warps
#             (TW_RS_REDUCE_WARPS): test_gemm_rs on both placements, A/B at flux-tp8 (both
#             orders, and with no reduce CTA), M=8192 and 16384 with the reduce CTAs, a trace,
#             and 8 virtual ranks. Slower; the code stays on exp/next29: its A/B rows need that
#             build
#     s35     (twenty-fourth session, measurements) flux-tp8 GEMM+RS's tail: the reduce CTAs
#             4 against 8 and 0, both orders, and traces at 0 and 8
#     s34     (twenty-fourth session, on exp/next27) the owner epilogue's lag
#             (TW_RS_OWNER_LAG): test_gemm_rs on both placements, A/B 200 / 50 / 100 at
#             flux-tp8 (owner epilogue forced), M=8192 and 16384, and the owner epilogue at lag
#             50 against the reduce CTAs. Shorter lags were slower; the knob was taken out
#     s33     (twenty-fourth session, on exp/next26 556e39b) the owner epilogue's tile order
#             with the reduce CTAs (TW_RS_LAG_ORDER): test_gemm_rs on both placements, A/B at
#             flux-tp8, M=8192 and M=16384, both orders, and a trace at flux-tp8. Slower
#             everywhere and taken out: its A/B rows need that build
#     s32     (twenty-fourth session, on exp/next26 6dc6626) the owner epilogue's L2 prefetch
#             of the peer's partials (TW_RS_OWNER_PREFETCH): test_gemm_rs on both placements,
#             A/B at flux-tp8 (owner epilogue forced) and M=8192 / 16384, both orders. The
#             prefetch measured slower and was taken out: its A/B rows need that build
#     s31     (twenty-third session) 8 virtual ranks: the unfused pipeline in the call
#             (TW_RS_UNFUSED_SMALL=1) against the fused kernel, every shape, both orders
#     s28     (twenty-second session, measurements) the decode GEMM: co-resident clusters of
#             8 and 16 (scripts/probes/probe_clusters.cu, built into $TW_BUILD_DIR), tw_gemm's
#             split rows from graphs at tw_ag_gemm's decode products, ncu of them and of
#             cuBLAS's; tw_ag_gemm at M=128 / 256 through the low-latency area (TW_AG_LL=1)
#     s27     (run in the twenty-second session: merged) tw_ag_gemm's decode GEMM as a programmatic dependent
#             of its allgather (TW_AG_PDL), its CTAs streaming B into L2 meanwhile: test_gemm's
#             after_grid cases, test_ag_gemm on both placements, memcheck, A/B from graphs
#             (alternating) and eager, tw_gemm alone at the decode product from graphs
#     s26     (run in the twenty-second session: merged) the GEMM's epilogue storing the low-latency words
#             (TW_RS_LL_EPI) and tw_allgather through the area (TW_AG_LL): tests on both
#             placements, memcheck, A/B from graphs and eager
#     s18c    (eighteenth session) main after the merge: split-K's tests and decode figures
#     s18b    (eighteenth session) exp/splitk-tree's build in $TW_BUILD_DIR/tree against this one
#             (test_gemm, split rows, ag_gemm at decode); the rules' checks
#     s18     (eighteenth session) exp/next18: the mended tests, then the benchmark parts of
#             the groups written for its five branches (removed: this one ran them, and the
#             suite their tests)
#     decode17 (the default; run in the seventeenth session) decode shapes (M 16/64/256) after
#             the pull where boxes straddle owners; test_gemm_rs on virtual ranks and distinct
#             GPUs
#     memo17  (run in the seventeenth session, merged) the TMA map memo: GPU tests, host cost off / on
#     next16  (run in the sixteenth session: both leads closed) 8 virtual ranks: ag_gemm's
#             gathered output by copy engine beside the no-gather GEMM (fused-ce-gather rows);
#             2 GPUs: ag_gemm's L2 group (TW_AG_GROUP_M=0,4,8 both orders) at flux-tp8, M=16384
#     fp32out15 (run in the fifteenth session) tw-bench gemm with fp32 output (TW_BENCH_GEMM_FP32=1) at the 2-GPU GEMM+RS shapes
#     final15 (fifteenth session) 8 virtual ranks, GEMM+AR / GEMM+RS at M=4096 K 512 in 6 rounds
#     l2h15   (run in the fifteenth session: the hints taken) L2 hints in the reduction / gather (-DTW_RS_DIAG=256 build in $TW_BUILD_DIR/diag256)
#             against the default, alternated, 8 virtual ranks and 2 GPUs; long interleaved
#             8-rank runs of ag_gemm and GEMM+AR at M=16384
#     wave15  (run in the fifteenth session: taken, GEMM+AR down to 4) 2 GPUs: the wave-boundary rule for reduce CTAs (-1)
#             against the old estimate's counts in A/B, both orders; test_gemm_rs on 2 GPUs
#     next15  (run in the fifteenth session) 2 GPUs: the reduce-CTA
#             count at the wave boundary (TW_RS_REDUCE_CTAS=-1,4 at flux-tp8 and GEMM+AR small
#             m, both orders); 8 virtual ranks: TW_TRACE of GEMM+AR / GEMM+RS at M=4096 K 512
#     knobs14 (run in the fourteenth session: every default stays) 8 virtual ranks with the
#             pull: TW_RS_BAND, TW_RS_GROUPED, TW_RS_REDUCE_CTAS (both ops), TW_AR_PUSH and
#             TW_RS_GROUP_UNITS (GEMM+AR) in A/B at short K
#     pull14  (run in the fourteenth session; the pull taken where more than 2 ranks share a
#             GPU) 8 virtual ranks: TW_RS_PULL=0,1 in A/B (both orders) for GEMM+RS / GEMM+AR
#             at short K, small m and M=16384; test_gemm_rs with the pull; the -DTW_RS_DIAG=1
#             build in $TW_BUILD_DIR/diag1 (every partial into the own slot)
#     diag13  (run in the fourteenth session) the consumers' wait for the previous tile's writes
#             before its signal: the default against a -DTW_RS_DIAG=64 build (signals after the
#             read-out; results wrong) in $TW_BUILD_DIR/diag64, GEMM+RS and GEMM+AR on 8 virtual
#             ranks at short K and on 2 GPUs (the 128 build, signalling two tiles behind, hung
#             test_gemm_rs and was removed)
#     grp13   8 virtual ranks: the group rule (one group per CTA on a shared GPU): test_gemm_rs,
#             A/B of the units per group at M=4096 and small m, the GEMM+AR bench
#     vr13    8 virtual ranks at M=4096 K 512: TW_TRACE of GEMM+RS / GEMM+AR, unit groups of
#             GEMM+AR in A/B (small m too), GEMM+AR with TW_BENCH_BLOCK=8
#     ar12    (thirteenth session, branch exp/ar-owner-epi, merged after) GEMM+AR with the owner
#             epilogue forced (TW_RS_OWNER_EPI=1): test_gemm_rs on one GPU and on 2, test_stall
#             on 2, A/B against 0 on 2 GPUs (symmetric outputs too) and on 2 virtual ranks
#     oe13    the owner-epilogue rule for tw_gemm_rs and tw_gemm_ar (fp32, K <
#             4096, at least 3 waves of tiles): test_gemm_rs on 1 and 2 GPUs, A/B of the rule
#             (-1) against 0 and 1 on 2 GPUs (small m too) and 2 virtual ranks, the plans logged
#     next12  (run in the thirteenth session) 8 virtual ranks: the plain
#             GEMM's grouped tile order for GEMM+RS / GEMM+AR at short K (TW_RS_GROUPED in A/B);
#             2 GPUs: every op with TW_BENCH_BLOCK=1 and 8 (the fork/join once per 8 calls)
#     diag12  8 virtual ranks, GEMM+RS at short K (M=4096 K 512, M=8192 K 1024)
#             with the measurement builds in $TW_BUILD_DIR/diagN (TW_DIAG12="2 4 8")
#     prime11 tw-bench's primed queue: A/B rows of the default value against the
#             main row on 2 GPUs; the host's enqueue time per repeat (2 GPUs, 8 vranks)
#     flux11  2 GPUs, flux-tp8: the reduce-CTA count of GEMM+RS / GEMM+AR in
#             A/B, and a warmed TW_TRACE of both
#     warm    TW_BENCH_WARM_MS: do rows of the same mode now agree; the copy-engine
#             rule in A/B on 2 GPUs; test_mp with the copy engine by default; 8-rank gemm_ar
# With TW_DIAG_LIBS="1 2 4 8 16 32" (builds in diagN/): where the fused GEMM phase loses its
# time, each bit removing one cost (first batch of the fifth session; bit 128, the fp32
# epilogue's second pass without its wait, since the twenty-seventh).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-experiments-out}
bin=${TW_BUILD_DIR:-build}
mkdir -p "$out/logs"
export LD_LIBRARY_PATH="$root/$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 NCCL_NVLS_ENABLE=0
ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
summary=()
run() { # run NAME LIMIT CMD...: log, and a summary line of the fused rows' median ms
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E '^(ag_gemm|gemm_rs|gemm_ar|gemm) ' \
    "$out/logs/$name.log" | grep -E ' (fused|fused-sm|fused-nogather|fused-inplace|copy-engine|tilewire[][A-Za-z0-9_=,-]*|fused\[[A-Z0-9_]*=[-0-9]*\]|gemm-alone|unfused|unfused-tw[a-z0-9-]*|nccl\+cublas|nccl-bf16\+cublas|nccl\+torch|nccl-bf16\+torch|cublas|cublas-fp32out|tw-[a-z0-9-]*) ' |
    awk '{for (i = 1; i <= NF; i++) if ($i ~ /^(fused|fused-sm|fused-nogather|fused-inplace|copy-engine|tilewire[][A-Za-z0-9_=,-]*|fused\[[A-Z0-9_]*=[-0-9]*\]|gemm-alone|unfused|unfused-tw[a-z0-9-]*|nccl\+cublas|nccl-bf16\+cublas|nccl\+torch|nccl-bf16\+torch|cublas|cublas-fp32out|tw-[a-z0-9-]*)$/) printf "%s %s  ", $i, $(i + 1)}')")")
  # A stall report (watchdog, expired wait, trapped pipeline) goes into the summary too.
  local stall
  stall=$(grep -m 3 -E 'watchdog|internal stall|DEVICE_TIMEOUT|timed out|waited for flag' "$out/logs/$name.log")
  [ -n "$stall" ] && summary+=("$(sed 's/^/    /' <<<"$stall")")
  return 0
}
run_new_old() { # run_new_old NAME LIMIT CMD...: CMD with this build's library, then with the
  # old one beside it (diagold/: scripts/diag-lib.sh 0 with an older gemm_rs_sm90.cu, or another
  # tree's build), twice, alternated; logs NAME-new-1, NAME-old-1, NAME-new-2, NAME-old-2. The
  # library by LD_LIBRARY_PATH (tw-bench, the tests) and TILEWIRE_LIB (python, bench_dist)
  local name=$1 limit=$2 i lib
  shift 2
  for i in 1 2; do
    for lib in new old; do
      local l="$root/$bin"
      [ $lib = old ] && l="$root/$bin/diagold"
      run "$name-$lib-$i" "$limit" env LD_LIBRARY_PATH="$l:$LD_LIBRARY_PATH" \
        TILEWIRE_LIB="$l/libtilewire.so" "$@"
    done
  done
}
big_rs="--m 16384 --n 16384 --k 2048"
flux_rs="--m 4096 --n 12288 --k 6144"
clocks() { # clocks NAME CMD...: the command with stamps, sampled; per-variant clocks in the summary
  local name=$1
  shift
  nvidia-smi --query-gpu=index,clocks.sm,power.draw --format=csv,noheader -lms 20 2>/dev/null |
    python3 -u -c 'import sys, time
for l in sys.stdin: print("%.3f, %s" % (time.time(), l.strip()), flush=True)' >"$out/logs/$name.smi" &
  local smi=$!
  sleep 0.5
  run "$name" 150 env TW_BENCH_STAMPS=1 TW_BENCH_ROUNDS=1 "$@" # one timing per row
  kill $smi 2>/dev/null
  pkill -f "nvidia-smi --query-gpu=index,clocks.sm" 2>/dev/null
  wait $smi 2>/dev/null
  python3 scripts/clocks_by_variant.py "$out/logs/$name.smi" "$out/logs/$name.log" >"$out/logs/$name.clocks" 2>&1
  summary+=("$(sed "s/^/  $name: /" "$out/logs/$name.clocks")")
}
trap 'tar czf "$out/experiments.tgz" -C "$out" logs; printf "%s\n" "${summary[@]}"; exit 1' TERM INT
exp_hang() { # the fifth session's stall: four 8-rank gemm_ar sweeps, the interleaved test twice
  for i in 1 2 3 4; do
    run "hang-vranks-gemm_ar-$i" 150 env TW_BENCH_VIRTUAL=1 TW_WATCHDOG_S=15 "$bin/tw-bench" \
      gemm_ar --repeats 20 --warmup 5
  done
  for i in 1 2; do
    run "hang-test_gemm_rs-interleave-$i" 90 env TW_RS_INTERLEAVE=1 TW_TEST_VERBOSE=1 \
      TW_WATCHDOG_S=15 stdbuf -oL -eL "$bin/test_gemm_rs"
  done
}
exp_ab() { # the fifth session's defaults against what they replaced, alternated twice
  for i in 1 2; do
    if [ "$ngpus" -gt 1 ]; then
      for il in -1 0; do
        for op in gemm_rs gemm_ar; do
          run "ab-gpus-$op-big-il$il-$i" 90 env TW_RS_INTERLEAVE=$il "$bin/tw-bench" $op \
            --world 2 $big_rs --repeats 20 --warmup 5
        done
      done
    fi
    for band in 0 8; do # 0: the plan's (single columns on a shared GPU)
      for op in gemm_rs gemm_ar; do
        run "ab-vranks-$op-flux-band$band-$i" 90 env TW_BENCH_VIRTUAL=1 TW_RS_BAND=$band \
          "$bin/tw-bench" $op $flux_rs --repeats 10 --warmup 3
      done
    done
  done
}
exp_flux() { # sixth session: Flux's shape on 2 GPUs, where RS/AR trail the bound (and AR with
  # bf16 partials trails NCCL bf16 + cuBLAS): the unfused bf16 pipeline as a fallback candidate,
  # interleaved owners for bf16 partials, the reduce-CTA count with bf16 partials
  [ "$ngpus" -gt 1 ] || return 0
  for i in 1 2; do
    for op in gemm_rs gemm_ar; do
      run "flux-gpus-$op-$i" 60 "$bin/tw-bench" $op --world 2 $flux_rs --repeats 30 --warmup 5
      run "flux-gpus-$op-il1-$i" 60 env TW_RS_INTERLEAVE=1 "$bin/tw-bench" $op --world 2 \
        $flux_rs --repeats 30 --warmup 5
    done
  done
  run "flux-gpus-gemm_ar-bf16-r" 90 env TW_BENCH_RS_SWEEP_BF16=1 TW_BENCH_RS_REDUCE_SMS=1,2,6,10 \
    "$bin/tw-bench" gemm_ar --world 2 $flux_rs --repeats 30 --warmup 5
}
exp_vranks() { # sixth session: 8 virtual ranks, where fused RS/AR trail the unfused pipeline:
  # the reduce-CTA count (fp32 and bf16 partials)
  for op in gemm_rs gemm_ar; do
    run "vranks-$op-flux-r" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_RS_REDUCE_SMS=1,2,4,6 \
      "$bin/tw-bench" $op $flux_rs --repeats 10 --warmup 3
  done
  run "vranks-gemm_rs-big-r" 150 env TW_BENCH_VIRTUAL=1 TW_BENCH_RS_REDUCE_SMS=1,3,6 \
    "$bin/tw-bench" gemm_rs $big_rs --repeats 5 --warmup 2
}
exp_bands() { # sixth session: band width on 8 virtual ranks. Single columns re-read A from HBM
  # once per column block (16 CTAs in flight: 16 row blocks x 1 column); bands of 2-4 share
  # each A row block among in-flight tiles while the eight ranks' B bands still fit in L2
  for band in 1 2 4; do
    for op in gemm_rs gemm_ar; do
      run "bands-vranks-$op-flux-band$band" 90 env TW_BENCH_VIRTUAL=1 TW_RS_BAND=$band \
        TW_BENCH_RS_REDUCE_SMS=1 "$bin/tw-bench" $op $flux_rs --repeats 10 --warmup 3
    done
  done
  for band in 1 2 4; do
    run "bands-vranks-gemm_rs-big-band$band" 90 env TW_BENCH_VIRTUAL=1 TW_RS_BAND=$band \
      "$bin/tw-bench" gemm_rs $big_rs --repeats 5 --warmup 2
  done
}
exp_push() { # sixth session: tw_gemm_ar's push gather (default on distinct GPUs only) checked
  # on both placements, then the 8-rank sweeps again (their spread between runs is 5-10%)
  run "push-test_gemm_rs-vranks" 150 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] && run "push-test_gemm_rs-gpus" 150 env TW_WATCHDOG_S=15 \
    TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] && run "push-gpus-gemm_ar" 90 "$bin/tw-bench" gemm_ar --world 2 \
    --repeats 20 --warmup 5
  for i in 1 2; do
    for op in gemm_ar gemm_rs ag_gemm; do
      run "push-vranks-$op-$i" 120 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" $op --repeats 10 \
        --warmup 3
    done
  done
}
exp_r0() { # after the sixth session: no reduce CTAs at the start (TW_RS_REDUCE_CTAS=0, every CTA
  # runs the GEMM, then reduces), against the plan's count; every sweep so far found fewer reduce
  # CTAs faster. test_gemm_rs first (its TW_RS_REDUCE_CTAS=0 case), then interleaved A/B rows
  # (TW_BENCH_AB, tools/bench/bench.h) on every shape.
  run "r0-test_gemm_rs-vranks" 150 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] && run "r0-test_gemm_rs-gpus" 150 env TW_WATCHDOG_S=15 \
    TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for op in gemm_rs gemm_ar; do
    [ "$ngpus" -gt 1 ] && run "r0-gpus-$op" 150 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=-1,0 \
      "$bin/tw-bench" $op --world 2 --repeats 24 --warmup 5
    run "r0-vranks-$op" 150 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=-1,0 TW_BENCH_VIRTUAL=1 \
      "$bin/tw-bench" $op --repeats 12 --warmup 3
  done
}
exp_w1() { # after the sixth session: the fused GEMM phase's own cost with no peer at all
  # (TW_RS_FUSED_W1=1: world 1 through the fused kernel), timed against tw_gemm with fp32 output
  # (the unfused-tw row), then both kernels under ncu (replay works: nothing waits on a peer)
  for shape in flux big; do
    args=$flux_rs
    [ $shape = big ] && args=$big_rs
    run "w1-$shape" 60 env TW_RS_FUSED_W1=1 TW_BENCH_AB=TW_RS_REDUCE_CTAS=-1,0 "$bin/tw-bench" \
      gemm_rs --world 1 $args --repeats 24 --warmup 5
  done
  if command -v ncu >/dev/null; then
    # the fused kernel (launches 3-4: timed repeats) and tw_gemm's (the unfused-tw row)
    run "w1-ncu-big" 300 env TW_RS_FUSED_W1=1 ncu --kernel-name-base demangled \
      --kernel-name regex:'gemm_rs_kernel|gemm_sm90_kernel' --launch-skip 2 --launch-count 4 \
      --set full --csv --page details "$bin/tw-bench" gemm_rs --world 1 $big_rs --repeats 2 \
      --warmup 1 --no-check
  fi
}
exp_wt() { # seventh session: the write-through gather (TW_AG_PEER_GATHER=1: the GEMM reads the
  # peers' slots in place, column block 0's tiles store the A boxes into a_gathered) on 8 virtual
  # ranks, test_ag_gemm on both placements first; and no reduce CTAs on shared GPUs (the new
  # RS/AR default there) against the estimate, twice
  run "wt-test_ag_gemm-vranks" 150 env TW_WATCHDOG_S=15 "$bin/test_ag_gemm"
  [ "$ngpus" -gt 1 ] && run "wt-test_ag_gemm-gpus" 150 env TW_WATCHDOG_S=15 \
    TW_TEST_DEVICES=distinct "$bin/test_ag_gemm"
  run "wt-test_gemm_rs-vranks" 150 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  run "wt-vranks-ag_gemm" 150 env TW_BENCH_AB=TW_AG_PEER_GATHER=0,1 TW_BENCH_VIRTUAL=1 \
    "$bin/tw-bench" ag_gemm --repeats 12 --warmup 3
  run "wt-vranks-ag_gemm-2" 150 env TW_BENCH_AB=TW_AG_PEER_GATHER=1,0 TW_BENCH_VIRTUAL=1 \
    "$bin/tw-bench" ag_gemm --repeats 12 --warmup 3
}
exp_wt2() { # after the seventh session: the spread write-through (TW_AG_PEER_GATHER=2: every
  # tile of a row block stores its share of the k-blocks; a column-0 write-through tile ran
  # 2-4.5x a normal one) against the push (0) and column 0's tiles (1), in both orders; the
  # test first (its peer-gather cases run modes 1, 2 and 0; eighth session: passed, mode 2 not
  # taken as a default)
  run "wt2-test_ag_gemm-vranks" 150 env TW_WATCHDOG_S=15 "$bin/test_ag_gemm"
  run "wt2-vranks-ag_gemm" 150 env TW_BENCH_AB=TW_AG_PEER_GATHER=0,1,2 TW_BENCH_VIRTUAL=1 \
    "$bin/tw-bench" ag_gemm --repeats 12 --warmup 3
  run "wt2-vranks-ag_gemm-2" 150 env TW_BENCH_AB=TW_AG_PEER_GATHER=2,1,0 TW_BENCH_VIRTUAL=1 \
    "$bin/tw-bench" ag_gemm --repeats 12 --warmup 3
}
spans() { # spans LOG: per traced call, each rank's first start (us after the earliest) and the
  # call's span (first start to last end) and longest rank (TW_TRACE lines with globaltimer)
  python3 - "$1" <<'PY'
import collections, re, sys
calls = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.search(r"rank (\d+) call (\d+):.*end max ([\d.]+);.*first start at ([\d.]+) us", line)
    if m:
        calls[int(m.group(2))].append((int(m.group(1)), float(m.group(4)), float(m.group(3))))
for c in sorted(calls)[:12]:
    v = sorted(calls[c])
    t0 = min(s for _, s, _ in v)
    print("    call %d starts %s | span %.0f us | longest rank %.0f us" % (c, " ".join(
        "%d:%.0f" % (r, s - t0) for r, s, _ in v), max(s + e for _, s, e in v) - t0,
        max(e for _, _, e in v)))
PY
}
exp_tr8() { # eighth session: where the fused RS/AR time goes on 8 virtual ranks (TW_TRACE):
  # the GEMM phase and the reduction after it, and whether the ranks start together
  for spec in "gemm_rs 8192 8192 1024" "gemm_rs 4096 4096 512" "gemm_ar 8192 8192 1024"; do
    set -- $spec
    run "tr8-$1-$2" 90 env TW_BENCH_VIRTUAL=1 TW_TRACE=1 "$bin/tw-bench" $1 --world 8 --m $2 \
      --n $3 --k $4 --repeats 3 --warmup 1 --no-check
    summary+=("$(spans "$out/logs/tr8-$1-$2.log")")
  done
}
exp_graph() { # eighth session: eager calls (and the host's enqueue time per repeat) against one
  # repeat captured in a CUDA graph and replayed, 8 virtual ranks
  for op in gemm_rs gemm_ar ag_gemm; do
    for g in 0 1; do
      run "graph$g-$op" 200 env TW_BENCH_GRAPH=$g TW_BENCH_STAMPS=1 TW_BENCH_VIRTUAL=1 \
        "$bin/tw-bench" $op --world 8 --repeats 15 --warmup 4
      summary+=("    host enqueue ms per repeat: $(grep 'host enqueue' "$out/logs/graph$g-$op.log" |
        awk '{printf "%s ", $4}')")
    done
  done
}
exp_tails() { # eighth session: the fused ag_gemm's slow tails at flux-tp8 on 8 virtual ranks
  # (p90 10.5-13.2 ms against medians of 8.6-10.3 in three suites; TW_TRACE showed whole calls
  # slowed on every rank at once, with no waits): SM clock and power per variant, sampled
  clocks "tails-ag-flux" env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" ag_gemm --world 8 --m 4096 \
    --n 6144 --k 12288 --repeats 60 --warmup 5
  # and the samples themselves during the fused rows, as a time series (ms since the first)
  python3 - "$out/logs/tails-ag-flux.smi" "$out/logs/tails-ag-flux.log" <<'PY' >"$out/logs/tails-series.txt"
import re, sys
st = {}
for l in open(sys.argv[2]):
    m = re.match(r"tw-bench stamp (\d+) (start|end) ([0-9.]+)", l)
    if m:
        st.setdefault(int(m.group(1)), {})[m.group(2)] = float(m.group(3))
s = st.get(4, {})  # timing 4: the fused row (unfused, unfused-tw, gemm-alone, allgather, fused)
pts = []
for l in open(sys.argv[1]):
    p = [x.strip() for x in l.split(",")]
    try:
        t, g, mhz, w = float(p[0]), int(p[1]), float(p[2].split()[0]), float(p[3].split()[0])
    except (ValueError, IndexError):
        continue
    if g == 0 and s and s["start"] <= t <= s["end"]:
        pts.append("%.0f:%.0f/%.0f" % ((t - s["start"]) * 1e3, mhz, w))
print("fused row, GPU 0, ms:MHz/W:", " ".join(pts))
PY
  summary+=("$(cut -c1-1500 "$out/logs/tails-series.txt")")
}
exp_ce() { # after the eighth session: the copy-engine mode with one process per GPU (test_mp now
  # runs every other tw_ag_gemm call in it; never run on a GPU), whether it is host-bound in long
  # back-to-back runs (TW_BENCH_STAMPS prints the enqueue time per repeat), and the default mode
  # against the SM-driven one at M=16384 in both bench methods (one block per variant, 4 rounds)
  if [ "$ngpus" -gt 1 ]; then
    run "ce-test_mp-gpus" 200 env TW_WATCHDOG_S=15 "$bin/test_mp" 2 40
    summary+=("    $(grep -c ' ok$' "$out/logs/ce-test_mp-gpus.log") ranks ok of 2: $(grep -m 2 -E 'FAILED|error|differ' "$out/logs/ce-test_mp-gpus.log" | tr '\n' ' ')")
    for r in 1 4; do
      run "ce-ag-16384-rounds$r" 120 env TW_BENCH_ROUNDS=$r TW_BENCH_STAMPS=1 "$bin/tw-bench" \
        ag_gemm --world 2 --m 16384 --n 2048 --k 16384 --repeats 40 --warmup 5
      summary+=("    host enqueue ms per repeat: $(grep 'host enqueue' "$out/logs/ce-ag-16384-rounds$r.log" |
        awk '{printf "%s ", $4}')")
    done
  fi
}
exp_warm() { # ninth session: each timing now warms for TW_BENCH_WARM_MS (100) first. Before,
  # ag_gemm's default-mode row (right after the light allgather row) beat the same mode two rows
  # later by 7-13% on 2 GPUs. Then the copy-engine rule in interleaved A/B, test_mp (copy engine
  # now by default with one process per GPU too), and the 8-rank gemm_ar rows under the new method
  if [ "$ngpus" -gt 1 ]; then
    run "warm-test_mp-gpus" 200 env TW_WATCHDOG_S=15 "$bin/test_mp" 2 40
    summary+=("    $(grep -c ' ok$' "$out/logs/warm-test_mp-gpus.log") ranks ok of 2")
    run "warm-ag-gpus" 150 "$bin/tw-bench" ag_gemm --world 2 --repeats 40 --warmup 5
    run "warm0-ag-gpus" 150 env TW_BENCH_WARM_MS=0 "$bin/tw-bench" ag_gemm --world 2 --repeats 40 \
      --warmup 5
    run "warm300-ag-16384" 60 env TW_BENCH_WARM_MS=300 "$bin/tw-bench" ag_gemm --world 2 \
      --m 16384 --n 2048 --k 16384 --repeats 40 --warmup 5
    run "warm-ab-autoce-gpus" 200 env TW_BENCH_AB=TW_AG_AUTO_CE=0,1 "$bin/tw-bench" ag_gemm \
      --world 2 --repeats 36 --warmup 5
  fi
  run "warm-vranks-gemm_ar" 150 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_ar --repeats 20 \
    --warmup 5
}
exp_diag9() { # ninth session's open questions (docs/PERF.md, Ninth session)
  local rs8="--m 8192 --n 8192 --k 1024 --repeats 3 --warmup 1 --no-check"
  run "diag9-tr-rs-8192" 90 env TW_BENCH_VIRTUAL=1 TW_TRACE=1 TW_BENCH_WARM_MS=0 "$bin/tw-bench" \
    gemm_rs $rs8
  run "diag9-tr-ar-8192" 90 env TW_BENCH_VIRTUAL=1 TW_TRACE=1 TW_BENCH_WARM_MS=0 "$bin/tw-bench" \
    gemm_ar $rs8
  if [ "$ngpus" -gt 1 ]; then
    local ag16="ag_gemm --world 2 --m 16384 --n 2048 --k 16384"
    for i in 1 2 3; do
      run "diag9-ce-$i" 60 "$bin/tw-bench" $ag16 --repeats 40 --warmup 5
    done
    run "diag9-ce-trace" 60 env TW_TRACE=1 TW_BENCH_WARM_MS=0 "$bin/tw-bench" $ag16 --repeats 8 \
      --warmup 2 --no-check
  fi
}
exp_groups() { # after the ninth session: is the 8-rank GEMM+AR's slow all-gather half the
  # per-item cost (a claim, a count or flag wait and, for the all-reduce, a sys fence and 7 flag
  # stores per 64 KiB unit)? test_gemm_rs runs TW_RS_GROUP_UNITS=3 in the suite
  for op in gemm_ar gemm_rs; do
    run "groups-vranks-$op" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_GROUP_UNITS=0,2,4,8 \
      "$bin/tw-bench" $op --repeats 24 --warmup 5
  done
  if [ "$ngpus" -gt 1 ]; then
    for op in gemm_ar gemm_rs; do
      run "groups-gpus-$op" 200 env TW_BENCH_AB=TW_RS_GROUP_UNITS=0,2,4,8 "$bin/tw-bench" $op \
        --world 2 --repeats 24 --warmup 5
    done
  fi
}
exp_g10() { # tenth session: the plan's coarser gather groups (TW_RS_GROUP_UNITS=0) against
  # single units (1), GEMM+AR on 8 virtual ranks and on 2 GPUs
  run "g10-vranks-gemm_ar" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_GROUP_UNITS=1,0 \
    "$bin/tw-bench" gemm_ar --repeats 24 --warmup 5
  if [ "$ngpus" -gt 1 ]; then
    run "g10-gpus-gemm_ar" 200 env TW_BENCH_AB=TW_RS_GROUP_UNITS=1,0 "$bin/tw-bench" gemm_ar \
      --world 2 --repeats 24 --warmup 5
  fi
}
exp_sym() { # tenth session: symmetric outputs (no gather copy, but the same per-group fence,
  # flag stores and gather waits) with coarser groups too?
  run "sym-vranks-gemm_ar" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
    TW_BENCH_AB=TW_RS_GROUP_UNITS=1,2,4 "$bin/tw-bench" gemm_ar --repeats 24 --warmup 5
  if [ "$ngpus" -gt 1 ]; then
    run "sym-gpus-gemm_ar" 200 env TW_BENCH_AB_OUTSYM=1 TW_BENCH_AB=TW_RS_GROUP_UNITS=1,2,4 \
      "$bin/tw-bench" gemm_ar --world 2 --repeats 24 --warmup 5
  fi
}
exp_push10() { # tenth session: with coarser groups, the push gather where ranks share a GPU
  # (the default there is the pull), and on 2 GPUs (where the push is the default)
  run "push10-vranks-gemm_ar" 150 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_AR_PUSH=0,1 \
    "$bin/tw-bench" gemm_ar --repeats 24 --warmup 5
  if [ "$ngpus" -gt 1 ]; then
    run "push10-gpus-gemm_ar" 100 env TW_BENCH_AB=TW_AR_PUSH=0,1 "$bin/tw-bench" gemm_ar \
      --world 2 --repeats 24 --warmup 5
  fi
}
exp_flux11() { # eleventh session: 2 GPUs, flux-tp8, where fp32 GEMM+RS / GEMM+AR stay at
  # 0.76-0.82 of the bound: the reduce-CTA count again (the plan: 5 / 7; last swept before the
  # interleaved order, the signal warp and the groups), and a warmed trace of both
  [ "$ngpus" -gt 1 ] || return 0
  run "flux11-rs-reduce" 120 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=0,2,3,5,8 "$bin/tw-bench" gemm_rs \
    --world 2 $flux_rs --repeats 30 --warmup 5
  run "flux11-ar-reduce" 120 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=0,2,4,7,10 "$bin/tw-bench" gemm_ar \
    --world 2 $flux_rs --repeats 30 --warmup 5
  for op in gemm_rs gemm_ar; do
    run "flux11-trace-$op" 60 env TW_TRACE=1 "$bin/tw-bench" $op --world 2 $flux_rs --repeats 10 \
      --warmup 3 --no-check
    spans "$out/logs/flux11-trace-$op.log" >"$out/logs/flux11-spans-$op.txt" 2>&1
  done
}
exp_prime11() { # eleventh session: tw-bench primes the queue with two untimed calls before its
  # timed repeats; A/B rows of a value equal to the default must now match the main row (they
  # ran 2-5% above it), and the host's enqueue time per repeat (TW_BENCH_STAMPS) on 2 GPUs
  [ "$ngpus" -gt 1 ] || return 0
  run "prime11-rs" 120 env TW_BENCH_AB=TW_RS_GROUP_UNITS=1,1 "$bin/tw-bench" gemm_rs --world 2 \
    --repeats 24 --warmup 5
  run "prime11-ar" 120 env TW_BENCH_AB=TW_AR_PUSH=1,1 "$bin/tw-bench" gemm_ar --world 2 \
    --repeats 24 --warmup 5
  run "prime11-stamps-rs" 60 env TW_BENCH_STAMPS=1 TW_BENCH_ROUNDS=1 "$bin/tw-bench" gemm_rs \
    --world 2 --repeats 24 --warmup 5
  run "prime11-stamps-ar8" 90 env TW_BENCH_STAMPS=1 TW_BENCH_ROUNDS=1 TW_BENCH_VIRTUAL=1 \
    "$bin/tw-bench" gemm_ar --repeats 16 --warmup 3
}
exp_oe12() { # GEMM+RS with each rank's own tiles reduced in their epilogue (TW_RS_OWNER_EPI,
  # 2 ranks): the tests first (one GPU, then distinct GPUs), then A/B of 0 against 1 in both
  # orders on 2 GPUs and on 2 virtual ranks, and a trace with it forced on
  run "oe12-test_gemm_rs" 150 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] && run "oe12-test_gemm_rs-gpus" 150 env TW_WATCHDOG_S=15 \
    TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  if [ "$ngpus" -gt 1 ]; then
    run "oe12-gpus-rs" 120 env TW_BENCH_AB=TW_RS_OWNER_EPI=0,1 "$bin/tw-bench" gemm_rs --world 2 \
      --repeats 24 --warmup 5
    run "oe12-gpus-rs-2" 120 env TW_BENCH_AB=TW_RS_OWNER_EPI=1,0 "$bin/tw-bench" gemm_rs \
      --world 2 --repeats 24 --warmup 5
    run "oe12-trace-flux" 60 env TW_TRACE=1 TW_RS_OWNER_EPI=1 "$bin/tw-bench" gemm_rs --world 2 \
      $flux_rs --repeats 10 --warmup 3 --no-check
  fi
  run "oe12-vranks2-rs" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_OWNER_EPI=0,1 \
    "$bin/tw-bench" gemm_rs --world 2 --repeats 24 --warmup 5
}
exp_oe12d() { # the owner-epilogue rule (tw_gemm_rs_want_owner_epi): rows of the rule against
  # both fixed values on 2 GPUs (it should match 1 below K 4096 and 0 from it); the plans
  run "oe12d-plans" 60 env TW_LOG_LEVEL=3 "$bin/tw-bench" gemm_rs --world 2 --quick --no-check
  local l
  while read -r l; do summary+=("    ${l#*tw_gemm_rs }"); done < <(grep -E 'tw_gemm_rs rank 0: .*owner_epi' \
    "$out/logs/oe12d-plans.log" | sort -u | head -8)
  [ "$ngpus" -gt 1 ] && run "oe12d-gpus-rs" 150 env TW_BENCH_AB=TW_RS_OWNER_EPI=0,-1,1 \
    "$bin/tw-bench" gemm_rs --world 2 --repeats 20 --warmup 5 --no-check
  return 0
}
exp_diag12() { # where the 8-rank fused GEMM+RS loses to the unfused pipeline at short K
  local d lib
  for d in 0 ${TW_DIAG12-2 4 8}; do
    lib="$root/$bin"
    [ "$d" = 0 ] || lib="$root/$bin/diag$d"
    [ -e "$lib/libtilewire.so.0" ] || continue
    run "diag12-vr-4096-d$d" 60 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" TW_BENCH_VIRTUAL=1 \
      "$bin/tw-bench" gemm_rs --world 8 --m 4096 --n 4096 --k 512 --repeats 20 --warmup 5 --no-check
    run "diag12-vr-8192-d$d" 60 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" TW_BENCH_VIRTUAL=1 \
      "$bin/tw-bench" gemm_rs --m 8192 --n 8192 --k 1024 --repeats 20 --warmup 5 --no-check
  done
}
exp_next12() { # prepared in the twelfth session (docs/PERF.md, its next experiments)
  local op shape
  for op in gemm_rs gemm_ar; do
    for shape in "--m 4096 --n 4096 --k 512" "--m 8192 --n 8192 --k 1024"; do
      run "next12-vr-$op-${shape// /}" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_GROUPED=0,1 \
        "$bin/tw-bench" $op $shape --repeats 24 --warmup 5
    done
  done
  [ "$ngpus" -gt 1 ] || return 0
  for op in ag_gemm gemm_rs gemm_ar; do
    run "next12-gpus-$op-block1" 150 "$bin/tw-bench" $op --world 2 --repeats 20 --warmup 5 --no-check
    run "next12-gpus-$op-block8" 150 env TW_BENCH_BLOCK=8 "$bin/tw-bench" $op --world 2 \
      --repeats 20 --warmup 5 --no-check
  done
}
exp_ar12() { # branch exp/ar-owner-epi (merged in the thirteenth session; exp_oe13 follows it)
  run "ar12-test_gemm_rs" 150 env TW_WATCHDOG_S=15 TW_RS_OWNER_EPI=1 "$bin/test_gemm_rs"
  if [ "$ngpus" -gt 1 ]; then
    run "ar12-test_gemm_rs-gpus" 150 env TW_WATCHDOG_S=15 TW_RS_OWNER_EPI=1 \
      TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
    run "ar12-test_stall-gpus" 150 env TW_RS_OWNER_EPI=1 TW_TEST_DEVICES=distinct "$bin/test_stall"
    run "ar12-gpus-ar" 150 env TW_BENCH_AB=TW_RS_OWNER_EPI=0,1 TW_BENCH_AB_OUTSYM=1 \
      "$bin/tw-bench" gemm_ar --world 2 --repeats 20 --warmup 5
  fi
  run "ar12-vranks2-ar" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_OWNER_EPI=0,1 \
    "$bin/tw-bench" gemm_ar --world 2 --repeats 20 --warmup 5
}
exp_oe13() { # thirteenth session: the owner-epilogue rule for both ops (fp32, K < 4096, >= 3 waves)
  local small="--m 1024 --n 8192 --k 2048"
  run "oe13-test_gemm_rs" 150 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  if [ "$ngpus" -gt 1 ]; then
    run "oe13-test_gemm_rs-gpus" 150 env TW_WATCHDOG_S=15 TW_TEST_DEVICES=distinct \
      "$bin/test_gemm_rs"
    run "oe13-gpus-ar" 150 env TW_BENCH_AB=TW_RS_OWNER_EPI=-1,0,1 TW_BENCH_AB_OUTSYM=1 \
      "$bin/tw-bench" gemm_ar --world 2 --repeats 20 --warmup 5
    run "oe13-gpus-rs" 150 env TW_BENCH_AB=TW_RS_OWNER_EPI=-1,0,1 \
      "$bin/tw-bench" gemm_rs --world 2 --repeats 20 --warmup 5
    run "oe13-gpus-rs-small" 60 env TW_BENCH_AB=TW_RS_OWNER_EPI=-1,0,1 \
      "$bin/tw-bench" gemm_rs --world 2 $small --repeats 20 --warmup 5
  fi
  run "oe13-vranks2-rs-small" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_OWNER_EPI=-1,0,1 \
    "$bin/tw-bench" gemm_rs --world 2 $small --repeats 20 --warmup 5
  run "oe13-plans" 60 env TW_LOG_LEVEL=3 "$bin/tw-bench" gemm_ar --world 2 --repeats 2 \
    --warmup 1 --no-check
}
exp_vr13() { # thirteenth session: 8 virtual ranks, GEMM+AR at short K (behind the unfused pipeline)
  local op shape small="--m 1024 --n 8192 --k 2048" s4="--m 4096 --n 4096 --k 512"
  for op in gemm_rs gemm_ar; do # trace lines of every fused row's calls, in row order
    run "vr13-trace-$op" 60 env TW_TRACE=1 TW_BENCH_VIRTUAL=1 "$bin/tw-bench" $op $s4 \
      --repeats 3 --warmup 1 --no-check
  done
  for shape in "$s4" "$small"; do
    run "vr13-ar-groups-${shape// /}" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_GROUP_UNITS=1,2,4,8 \
      "$bin/tw-bench" gemm_ar $shape --repeats 20 --warmup 5
  done
  run "vr13-ar-block8" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_BLOCK=8 "$bin/tw-bench" gemm_ar $s4 \
    --repeats 20 --warmup 5 --no-check
}
exp_next16() { # prepared in the fifteenth session, not run: on 8 virtual ranks, the gathered
  # output by copy engine beside the in-place no-gather GEMM (tw-bench ag_gemm's
  # fused-ce-gather rows, TW_BENCH_AG_CE_GATHER=1, checked bitwise, C and gathered A) against
  # the default write-through and fused-nogather, in 4 interleaved rounds: if it lands near
  # fused-nogather (0.96 overlap at M=16384), the library can take it where ranks share a GPU
  local shape
  for shape in "--m 16384 --n 2048 --k 16384" "--m 8192 --n 1024 --k 8192" \
    "--m 4096 --n 6144 --k 12288"; do
    run "next16-ceg-${shape// /}" 150 env TW_BENCH_VIRTUAL=1 TW_BENCH_AG_CE_GATHER=1 \
      TW_BENCH_ROUNDS=4 "$bin/tw-bench" ag_gemm $shape --repeats 24 --warmup 3
  done
  # 2 GPUs: ag_gemm's L2 group (16 row blocks, one shard, by the plan) never swept there; the
  # literal yardstick wants flux-tp8 about 1-2% faster (0.941-0.954 ms against 0.935)
  [ "$ngpus" -gt 1 ] || return 0
  for shape in "--m 4096 --n 6144 --k 12288" "--m 16384 --n 2048 --k 16384"; do
    for ab in 0,4,8 8,4,0; do
      run "next16-group-${shape// /}-$ab" 90 env TW_BENCH_AB=TW_AG_GROUP_M=$ab "$bin/tw-bench" \
        ag_gemm $shape --world 2 --repeats 24 --warmup 5
    done
  done
}
# tw-bench gemm_ar and gemm_rs on 2 GPUs at a decode shape: M=$2, n 8192, K 1024 (a TP=8
# Llama-70B attention-out projection), logs named $1-<op>-m$2
decode_rs_rows() {
  local op
  for op in gemm_ar gemm_rs; do
    run "$1-$op-m$2" 90 "$bin/tw-bench" $op --world 2 --m "$2" --n 8192 --k 1024 --repeats 50 \
      --warmup 5
  done
}
exp_next17() { # prepared in the sixteenth session, run in the seventeenth (2 GPUs only)
  [ "$ngpus" -gt 1 ] || return 0
  local m op py="env TILEWIRE_LIB=$root/$bin/libtilewire.so PYTHONPATH=$root/python"
  # Decode-sized shapes (a TP=8 Llama-70B layer per rank: hidden 8192, attention-out K 1024):
  # the fused ops against NCCL + cuBLAS where the fused kernel's fixed costs dominate
  for m in 16 64 256; do
    decode_rs_rows next17 $m
    run "next17-ag_gemm-m$m" 90 "$bin/tw-bench" ag_gemm --world 2 --m $m --n 1024 --k 8192 \
      --repeats 50 --warmup 5
    # the GEMM core there against cuBLAS (128-row tiles with M <= 256 leave most SMs idle)
    run "next17-gemm-m$m" 60 "$bin/tw-bench" gemm --m $m --n 8192 --k 1024 --repeats 50 \
      --warmup 5
  done
  # one process per GPU, with torch.profiler's kernel timeline (--profile: each call's busy
  # and idle GPU time): at M=64, and at flux-tp8 (the ~0.1 ms per call that the kernels'
  # traced spans do not cover)
  for op in gemm_ar gemm_rs; do
    run "next17-dist-$op-m64" 120 $py python3 -m tilewire.bench_dist --nproc 2 --op $op --m 64 \
      --n 8192 --k 1024 --repeats 50 --profile
    run "next17-dist-$op-flux" 150 $py python3 -m tilewire.bench_dist --nproc 2 --op $op \
      --m 4096 --n 12288 --k 6144 --repeats 30 --profile
  done
  run "next17-dist-ag_gemm-m64" 120 $py python3 -m tilewire.bench_dist --nproc 2 --op ag_gemm \
    --m 64 --n 1024 --k 8192 --repeats 50 --profile
  # Where a tiny GEMM+AR's ~30 us go (handshakes, reduction, gather); and GEMM+AR at M=16384,
  # whose bf16-partials rows reach only 0.69-0.73 overlap against the bf16 pipeline (the
  # fused op 2.34-2.45 ms against a 1.65 ms GEMM: is the gather a serial tail?)
  run "next17-trace-gemm_ar-m64" 60 env TW_TRACE=1 TW_BENCH_STAMPS=1 "$bin/tw-bench" gemm_ar \
    --world 2 --m 64 --n 8192 --k 1024 --repeats 20 --warmup 5
  run "next17-trace-gemm_ar-16384" 90 env TW_TRACE=1 TW_BENCH_STAMPS=1 "$bin/tw-bench" gemm_ar \
    --world 2 $big_rs --repeats 10 --warmup 3
  # If that tail is the reduction's backlog (few reduce CTAs during the GEMM): more of them
  local ab
  for ab in -1,16,32 32,16,-1; do
    run "next17-ar16384-reduce-$ab" 120 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab "$bin/tw-bench" \
      gemm_ar --world 2 $big_rs --repeats 20 --warmup 5
  done
  # ag_gemm one process per GPU: the own shard's copy (fused-inplace skips it; the copy
  # engine can make it, TW_AG_OWN_COPY_CE=1)
  local ce shape
  for shape in "--m 4096 --n 6144 --k 12288" "--m 16384 --n 2048 --k 16384"; do
    for ce in 0 1; do
      run "next17-dist-ag-own$ce-${shape// /}" 150 $py TW_AG_OWN_COPY_CE=$ce python3 -m \
        tilewire.bench_dist --nproc 2 --op ag_gemm $shape --repeats 30
    done
  done
}
exp_decode17() { # seventeenth session: decode shapes with the pull where boxes straddle owners
  # (m_local % 64 != 0; before: GEMM+AR M=64 0.123 ms, M=16 0.069, tw_gemm + reduce 0.033)
  run "decode17-test_gemm_rs" 200 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "decode17-test_gemm_rs-distinct" 200 env TW_WATCHDOG_S=15 TW_TEST_DEVICES=distinct \
    "$bin/test_gemm_rs"
  local m op py="env TILEWIRE_LIB=$root/$bin/libtilewire.so PYTHONPATH=$root/python"
  for m in 16 64 256; do
    decode_rs_rows decode17 $m
  done
  # the push at M=64 for comparison (TW_RS_PULL=0: one thread's stores for straddling boxes)
  run "decode17-gemm_ar-m64-push" 90 env TW_BENCH_AB=TW_RS_PULL=0,1 "$bin/tw-bench" gemm_ar \
    --world 2 --m 64 --n 8192 --k 1024 --repeats 50 --warmup 5
  run "decode17-trace-gemm_ar-m64" 60 env TW_TRACE=1 "$bin/tw-bench" gemm_ar --world 2 --m 64 \
    --n 8192 --k 1024 --repeats 10 --warmup 3
  for op in gemm_ar gemm_rs; do
    run "decode17-dist-$op-m64" 120 $py python3 -m tilewire.bench_dist --nproc 2 --op $op \
      --m 64 --n 8192 --k 1024 --repeats 50
  done
}
exp_s18() { # eighteenth session, exp/next18 after its suite (tests there passed but for two
  # test bugs, mended): the benchmark parts of the groups written for exp/ag-decode, exp/rs-n128,
  # exp/own-ce, exp/dist-graph and exp/gemm-splitk (since removed) in one call, the mended
  # tests first
  run "s18-test_gemm" 120 "$bin/test_gemm"
  run "s18-test_stall" 90 "$bin/test_stall"
  local shape m op ab ce py="env TILEWIRE_LIB=$root/$bin/libtilewire.so PYTHONPATH=$root/python"
  for shape in "--m 64 --n 1024 --k 8192" "--m 16 --n 1024 --k 8192" "--m 64 --n 8192 --k 1024" \
    "--m 1024 --n 1024 --k 1024" "--m 4096 --n 4096 --k 4096"; do
    run "s18-gemm-${shape// /}" 60 env TW_BENCH_GEMM_SPLITK=1 "$bin/tw-bench" gemm $shape \
      --repeats 50 --warmup 5
  done
  [ "$ngpus" -gt 1 ] || return 0
  run "s18-test_stall-distinct" 90 env TW_TEST_DEVICES=distinct "$bin/test_stall"
  # ag_gemm: the unfused split-K path against the fused kernel (decode; and the mid shapes the
  # rule takes: 64 tiles at K 1024, 32 at K 4096)
  for shape in "--m 64 --n 1024 --k 8192" "--m 16 --n 1024 --k 8192" "--m 256 --n 1024 --k 8192" \
    "--m 1024 --n 1024 --k 1024" "--m 512 --n 2048 --k 4096"; do
    for ab in 1,0 0,1; do
      run "s18-ag-${shape// /}-$ab" 60 env TW_BENCH_AB=TW_AG_UNFUSED_SMALL=$ab "$bin/tw-bench" \
        ag_gemm --world 2 $shape --repeats 50 --warmup 5
    done
  done
  # GEMM+RS / GEMM+AR tile width at decode, both orders at M=64
  for m in 64 16 256; do
    for op in gemm_ar gemm_rs; do
      for ab in 256,128 128,256; do
        [ "$m" != 64 ] && [ "$ab" = 128,256 ] && continue
        run "s18-$op-m$m-$ab" 60 env TW_BENCH_AB=TW_RS_BLOCK_N=$ab "$bin/tw-bench" $op \
          --world 2 --m $m --n 8192 --k 1024 --repeats 50 --warmup 5
      done
    done
  done
  for ab in 0,1 1,0; do
    run "s18-gemm_ar-m64-direct-$ab" 60 env TW_BENCH_AB=TW_AR_DIRECT=$ab "$bin/tw-bench" \
      gemm_ar --world 2 --m 64 --n 8192 --k 1024 --repeats 50 --warmup 5
  done
  run "s18-8v-gemm_ar-decode" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_BLOCK_N=256,128 \
    "$bin/tw-bench" gemm_ar --m 64 --n 8192 --k 1024 --repeats 30 --warmup 5
  # GPU time per call (CUDA-graph replays) one process per GPU at decode
  dist_graph s18-graph m64 90 "--repeats 50 --graph 20" "--m 64 --n 8192 --k 1024" \
    "--m 64 --n 1024 --k 8192"
  # the own-shard copy by copy engine by rule against 0, both orders
  for shape in "--m 4096 --n 6144 --k 12288" "--m 4096 --n 512 --k 4096"; do
    for ce in -1 0 0 -1; do
      run "s18-ownce$ce-${shape// /}" 60 $py TW_AG_OWN_COPY_CE=$ce python3 -m \
        tilewire.bench_dist --nproc 2 --op ag_gemm $shape --repeats 30
    done
  done
}
exp_s22() { # prepared in the twentieth session (exp/swap-ab, not run): tw_gemm at m <= 64 on
  # swapped tiles (C^T = B A^T, wgmma n16 / n64) against the 128-row tiles: bits first, then
  # time (cuBLAS's decode kernels are swapped: ncu, PERF's twentieth session)
  local shape m op v
  run "s22-test_gemm" 150 "$bin/test_gemm"
  run "s22-test_ag_gemm" 150 "$bin/test_ag_gemm"
  run "s22-test_gemm_rs" 200 "$bin/test_gemm_rs"
  for shape in "--m 16 --n 8192 --k 1024" "--m 64 --n 8192 --k 1024" "--m 64 --n 1024 --k 8192" \
    "--m 16 --n 1024 --k 8192" "--m 32 --n 28672 --k 4096" "--m 64 --n 8192 --k 3584"; do
    run "s22-gemm-graph-${shape// /}" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_SPLITK=1 \
      "$bin/tw-bench" gemm $shape --repeats 50 --warmup 5
  done
  run "s22-gemm-eager-m16" 60 env TW_BENCH_GEMM_SPLITK=1 "$bin/tw-bench" gemm --m 16 --n 8192 \
    --k 1024 --repeats 50 --warmup 5
  # the fp32 epilogue's shared stores, odd rows rotated (exp/next21): bank conflicts under ncu
  # (4.2-way before, docs/PERF.md) and the fp32-out rows' time (PERF's earlier suites)
  run "s22-ncu-fp32out" 120 env TW_BENCH_WARM_MS=0 TW_BENCH_GEMM_FP32=1 ncu --clock-control none \
    --kernel-name-base demangled -k "regex:gemm_sm90_kernel.*EpiTmaStore<float>" \
    --section MemoryWorkloadAnalysis_Tables --section SpeedOfLight -c 2 \
    "$bin/tw-bench" gemm --m 4096 --n 4096 --k 4096 --repeats 2 --warmup 1 --no-check
  run "s22-gemm-fp32out" 60 env TW_BENCH_GEMM_FP32=1 "$bin/tw-bench" gemm --quick
  run "s22-ncu-m16" 90 env TW_BENCH_WARM_MS=0 ncu --clock-control none \
    -k "regex:gemm|nvjet" --section SpeedOfLight --section LaunchStats -c 8 "$bin/tw-bench" \
    gemm --m 16 --n 8192 --k 1024 --repeats 3 --warmup 1 --no-check
  [ "$ngpus" -gt 1 ] || return 0
  run "s22-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for m in 16 64; do
    for op in gemm_rs gemm_ar; do
      run "s22-$op-ab-m$m" 90 env TW_BENCH_AB=TW_GEMM_SWAP=0,-1 "$bin/tw-bench" $op --world 2 \
        --m $m --n 8192 --k 1024 --repeats 30 --warmup 5
    done
    run "s22-ag-ab-m$m" 90 env TW_BENCH_AB=TW_GEMM_SWAP=0,-1 "$bin/tw-bench" ag_gemm --world 2 \
      --m $m --n 1024 --k 8192 --repeats 30 --warmup 5
  done
  for v in 0 -1; do
    for m in 16 64; do
      TW_GEMM_SWAP=$v dist_graph "s22-dist-graph-swap$v" "m$m" 60 "--repeats 50 --graph 20" \
        "--m $m --n 8192 --k 1024" ""
    done
  done
  # exp/next21: the reduce kernel by programmatic dependent launch (TW_RS_UNFUSED_PDL)
  for m in 16 64; do
    for op in gemm_rs gemm_ar; do
      run "s22-$op-pdl-m$m" 90 env TW_BENCH_AB=TW_RS_UNFUSED_PDL=0,1 "$bin/tw-bench" $op \
        --world 2 --m $m --n 8192 --k 1024 --repeats 30 --warmup 5
    done
  done
  for v in 0 1; do
    TW_RS_UNFUSED_PDL=$v dist_graph "s22-dist-graph-pdl$v" m16 60 "--repeats 50 --graph 20" \
      "--m 16 --n 8192 --k 1024" ""
  done
}
exp_s24() { # twenty-first session (exp/swap64, not run): swap-AB on 64-row tiles (TW_GEMM_SWAP=2,
  # the rule's choice where 128-row tiles fill at most half the SMs): the bits across the ops,
  # the gemm rows from graphs with both swap heights forced, ncu of the decode GEMM
  local shape
  run "s24-test_gemm" 150 "$bin/test_gemm"
  run "s24-test_ag_gemm" 150 "$bin/test_ag_gemm"
  run "s24-test_gemm_rs" 200 "$bin/test_gemm_rs"
  run "s24-test_plans" 30 "$bin/test_plans"
  for shape in "--m 16 --n 8192 --k 1024" "--m 64 --n 8192 --k 1024" "--m 1 --n 8192 --k 1024" \
    "--m 64 --n 8192 --k 3584" "--m 16 --n 4096 --k 4096" "--m 32 --n 28672 --k 4096"; do
    run "s24-gemm-graph-${shape// /}" 60 env TW_BENCH_GRAPH=1 "$bin/tw-bench" gemm $shape \
      --repeats 50 --warmup 5
  done
  run "s24-gemm-eager-m16" 60 "$bin/tw-bench" gemm --m 16 --n 8192 --k 1024 --repeats 50 \
    --warmup 5
  run "s24-ncu-m16" 90 env TW_BENCH_WARM_MS=0 ncu --clock-control none \
    -k "regex:gemm|nvjet" --section SpeedOfLight --section LaunchStats -c 10 "$bin/tw-bench" \
    gemm --m 16 --n 8192 --k 1024 --repeats 3 --warmup 1 --no-check
  run "s24-memcheck-test_gemm" 200 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm" --small
  [ "$ngpus" -gt 1 ] || return 0
  for m in 16 64; do
    for v in 1 -1; do
      TW_GEMM_SWAP=$v dist_graph "s24-dist-graph-swap$v" "m$m" 60 "--repeats 50 --graph 20" \
        "--m $m --n 8192 --k 1024" ""
    done
  done
}
dist_decode() { # dist_decode TAG M...: bench_dist's GEMM+RS and GEMM+AR rows at each M (n 8192,
  # K 1024 a rank), one process per GPU, from graphs of 10 calls
  local tag=$1 m
  shift
  for m in "$@"; do
    run "$tag-dist-m$m" 120 env TILEWIRE_LIB="$root/$bin/libtilewire.so" PYTHONPATH="$root/python" \
      python3 -m tilewire.bench_dist --nproc 2 --op gemm_rs --op gemm_ar --m "$m" --n 8192 \
      --k 1024 --graph 10 --repeats 30
  done
}
decode_block10() { # decode_block10 TAG: tw-bench's decode rows of GEMM+AR and GEMM+RS on 2 GPUs
  # from graphs of 10 calls a rank between one fork and join, 5 interleaved rounds
  local op m
  for op in gemm_ar gemm_rs; do
    for m in 64 16; do
      run "$1-$op-m$m-graph-block10" 90 env TW_BENCH_GRAPH=1 TW_BENCH_BLOCK=10 TW_BENCH_ROUNDS=5 \
        "$bin/tw-bench" $op --world 2 --m $m --n 8192 --k 1024 --repeats 40 --warmup 10
    done
  done
}
dist_new_old() { # dist_new_old NAME LIMIT ARGS...: run_new_old of bench_dist, one process a GPU
  local name=$1 limit=$2
  shift 2
  run_new_old "$name" "$limit" env PYTHONPATH="$root/python" python3 -m tilewire.bench_dist \
    --nproc 2 "$@"
}
exp_s97() { # (exp/lean-consumer; run and merged in the thirty-fifth session) the
  # cooperative loop's consumers build each stage's wgmma descriptors from 32-bit low words (the
  # high word a constant) instead of 64-bit adds: ~12 fewer instructions a stage on the decode
  # tiles' critical path (ncu: the consumers' descriptor arithmetic and R2UR, 17% of the executed
  # instructions at M=128 N=4096 K=4096). Tests first (every kernel's consumers changed), then
  # tw_gemm from graphs against main's library (diagold/: scripts/pack-build.sh build
  # MAIN_BUILD build-dev/diagold), alternated twice; and the fused ops at flux-tp8 on one GPU
  local s
  run "s97-test_gemm" 120 "$bin/test_gemm"
  run "s97-test_ag_gemm" 120 "$bin/test_ag_gemm"
  run "s97-test_gemm_rs" 240 "$bin/test_gemm_rs"
  for s in "--m 128 --n 4096 --k 4096" "--m 64 --n 4096 --k 4096" "--m 64 --n 8192 --k 1024" \
    "--m 16 --n 8192 --k 4096" "--m 64 --n 1024 --k 8192" "--m 4096 --n 6144 --k 12288"; do
    # shellcheck disable=SC2086
    run_new_old "s97-gemm${s// /}" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_ROUNDS=5 "$bin/tw-bench" \
      gemm $s --repeats 50 --warmup 5
  done
}
new_old_decode() { # new_old_decode PREFIX M SHAPE...: tw_gemm at each SHAPE from graphs, then
  # GEMM+RS / GEMM+AR at m M N=8192 K=1024 on 2 virtual ranks (the decode pipelines), each with
  # this build's library and then the old one (diagold/), once
  local pre=$1 m=$2 s lib l
  shift 2
  for s in "$@"; do
    for lib in new old; do
      l="$root/$bin"
      [ $lib = old ] && l="$root/$bin/diagold"
      # shellcheck disable=SC2086
      run "$pre-gemm${s// /}-$lib" 60 env LD_LIBRARY_PATH="$l:$LD_LIBRARY_PATH" TW_BENCH_GRAPH=1 \
        TW_BENCH_GEMM_ROUNDS=5 "$bin/tw-bench" gemm $s --repeats 50 --warmup 5
    done
  done
  for s in gemm_rs gemm_ar; do
    for lib in new old; do
      l="$root/$bin"
      [ $lib = old ] && l="$root/$bin/diagold"
      run "$pre-$s-m$m-vranks-$lib" 60 env LD_LIBRARY_PATH="$l:$LD_LIBRARY_PATH" TW_BENCH_GRAPH=1 \
        "$bin/tw-bench" $s --world 2 --m "$m" --n 8192 --k 1024 --repeats 50 --warmup 10
    done
  done
}
exp_s105() { # (thirty-sixth session, prepared) see the header
  if [ -x "$bin/probe_multicast" ]; then
    run "s105-probe-multicast" 120 "$bin/probe_multicast"
  else
    echo "s105: $bin/probe_multicast not built (scripts/probes/probe_multicast.cu's header)" >&2
  fi
}
exp_s101() { # (thirty-fifth session, merged) see the header
  new_old_decode s101 32 "--m 32 --n 4096 --k 4096" "--m 32 --n 8192 --k 1024" \
    "--m 24 --n 4096 --k 4096"
}
exp_s100() { # (thirty-fifth session, merged) see the header
  run "s100-test_gemm" 120 "$bin/test_gemm"
  run "s100-test_ag_gemm" 120 "$bin/test_ag_gemm"
  run "s100-test_gemm_rs" 240 "$bin/test_gemm_rs"
  new_old_decode s100 64 "--m 128 --n 4096 --k 4096" "--m 64 --n 4096 --k 4096" \
    "--m 32 --n 4096 --k 4096" "--m 64 --n 8192 --k 1024" "--m 16 --n 8192 --k 1024" \
    "--m 16 --n 8192 --k 4096" "--m 128 --n 8192 --k 1024" "--m 64 --n 1024 --k 8192"
}
exp_s96() { # (thirty-fourth session) the producer's per-stage loop without re-deriving the
  # shared window's base (ptx::smem_align1024; ncu's source counters at M=128 N=4096 K=4096 had the
  # producer warp issuing all the time and never waiting for a free stage, about 75 instructions
  # a stage with two S2UR, where cuBLAS's waits): tw_gemm from graphs, this library / the old
  # one (diagold/: main c5eaea4) alternated twice
  local s
  for s in "--m 128 --n 4096 --k 4096" "--m 64 --n 4096 --k 4096" "--m 64 --n 8192 --k 1024" \
    "--m 16 --n 8192 --k 4096" "--m 64 --n 1024 --k 8192" "--m 4096 --n 6144 --k 12288" \
    "--m 8192 --n 8192 --k 1024"; do
    # shellcheck disable=SC2086
    run_new_old "s96-gemm${s// /}" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_ROUNDS=5 "$bin/tw-bench" \
      gemm $s --repeats 50 --warmup 5
  done
}
exp_s94() { # (thirty-third session, prepared) the decode GEMM core at M=128 N=4096 K=4096:
  # cuBLAS's nvjet_sm90_tst_64x64_64x13_2x1 (128 CTAs in pairs, 13 stages) took 16.1 us under ncu
  # against tw_gemm's 25.1 with the same DRAM bytes and half the issued instructions; here each
  # kernel's warp stall sampling by source line. Then the 8-virtual-rank decode GEMM+AR (the
  # call's own host path: its kernels run apart read 0.087 ms, the call 0.146) with TW_TRACE.
  local k
  if command -v ncu >/dev/null; then
    for k in nvjet gemm_sm90; do
      run "s94-ncu-$k" 150 ncu --kernel-name "regex:$k" --launch-count 1 --section WarpStateStats \
        --section SourceCounters --section SchedulerStats --section InstructionStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis "$bin/tw-bench" gemm \
        --m 128 --n 4096 --k 4096 --repeats 2 --warmup 1
    done
  fi
  run "s94-gemm_ar-decode-trace" 120 env TW_BENCH_VIRTUAL=1 TW_TRACE=1 TW_BENCH_STAMPS=1 \
    "$bin/tw-bench" gemm_ar --world 8 --m 64 --n 8192 --k 1024 --repeats 20 --warmup 5
  run "s94-gemm_ar-decode-ab" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_UNFUSED_SMALL=-1,0,1 \
    "$bin/tw-bench" gemm_ar --world 8 --m 64 --n 8192 --k 1024 --repeats 50 --warmup 10
}
exp_s92() { # (thirty-second session) the 192-column rule counts the comm's world (tw_gemm_ar's
  # direct scheme, planned as one owner, takes it at flux-tp8 with bf16 partials)
  run "s92-test_gemm_rs" 240 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s92-test_gemm_rs-distinct" 240 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  # shellcheck disable=SC2086
  run "s92-gemm_ar-flux" 120 env TW_BENCH_AB=TW_RS_BLOCK_N=0,256,0 "$bin/tw-bench" gemm_ar \
    --world 2 $flux_rs --repeats 20 --warmup 5
}
exp_s91() { # (thirty-second session) flux-tp8 on the ping-pong loop's 192-column tiles: the
  # reduce CTAs and the band there, and K 4096 at the rule's edge (2 GPUs only)
  [ "$ngpus" -gt 1 ] || return 0
  local op
  for op in gemm_rs gemm_ar; do
    # shellcheck disable=SC2086
    run "s91-$op-flux-reduce" 150 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=-1,0,2,8 "$bin/tw-bench" $op \
      --world 2 $flux_rs --repeats 20 --warmup 5
  done
  # shellcheck disable=SC2086
  run "s91-gemm_rs-flux-band" 150 env TW_BENCH_AB=TW_RS_BAND=0,1,4,16 "$bin/tw-bench" gemm_rs \
    --world 2 $flux_rs --repeats 20 --warmup 5
  for op in gemm_rs gemm_ar; do
    run "s91-$op-k4096" 120 env TW_BENCH_AB=TW_RS_BLOCK_N=0,256,0 "$bin/tw-bench" $op --world 2 \
      --m 8192 --n 8192 --k 4096 --repeats 20 --warmup 5
  done
}
exp_s90() { # (thirty-second session) the ping-pong loop in tw_gemm_rs / tw_gemm_ar
  # (TW_RS_BLOCK_N=192: 128 x 192 tiles, each one consumer warpgroup's; s89: tw_gemm's pp192
  # level with bf16 out and 4-10% faster with fp32 out): tests with its cases, then A/B on 2 GPUs
  run "s90-test_gemm_rs" 240 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s90-test_gemm_rs-distinct" 240 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  local op shape ab
  for shape in "$flux_rs" "$big_rs" "--m 8192 --n 8192 --k 1024" "--m 4096 --n 4096 --k 512"; do
    for op in gemm_rs gemm_ar; do
      for ab in 0,192 192,0; do
        [ "$ab" = 192,0 ] && [ "$shape" != "$flux_rs" ] && [ "$shape" != "$big_rs" ] && continue
        # shellcheck disable=SC2086
        run "s90-$op${shape// /}-ab${ab/,/-}" 120 env TW_BENCH_AB=TW_RS_BLOCK_N=$ab \
          "$bin/tw-bench" $op --world 2 $shape --repeats 20 --warmup 5
      done
    done
  done
}
exp_s89() { # (thirty-second session) ping-pong consumers (TW_GEMM_V_PP_N128, gemm_pp_sm90.cuh):
  # test_gemm (every variant bitwise the default's), then the plain GEMM's rows with the
  # variants and fp32 output: does hiding the epilogue beat the cooperative 128 x 256 tiles?
  run "s89-test_gemm" 300 "$bin/test_gemm"
  run "s89-test_ag_gemm" 200 "$bin/test_ag_gemm" # and tw_gemm's swap rule past m 64 (7ce6802)
  run "s89-test_gemm_rs" 200 "$bin/test_gemm_rs"
  local shape
  for shape in "--m 4096 --n 12288 --k 6144" "--m 4096 --n 6144 --k 12288" \
    "--m 16384 --n 16384 --k 2048" "--m 8192 --n 8192 --k 8192" "--m 8192 --n 8192 --k 1024" \
    "--m 4096 --n 4096 --k 512"; do
    # shellcheck disable=SC2086
    run "s89-gemm${shape// /}" 120 env TW_BENCH_GEMM_VARIANTS=1 TW_BENCH_GEMM_FP32=1 \
      "$bin/tw-bench" gemm $shape --repeats 30 --warmup 5
  done
}
exp_s88() { # (thirty-second session) the wait-unpack-sum over the peers' words as one helper
  # (ll_sum_item, rs_vec.cuh) in the swap-AB epilogue's own rows and ll_reduce_kernel: the same
  # bits, so the tests as they are, then the decode rows against the old library (diagold)
  run "s88-test_gemm_rs" 240 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s88-test_gemm_rs-distinct" 240 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  local m
  for m in 16 64; do
    dist_new_old "s88-dist-m$m" 120 --op gemm_rs --op gemm_ar --m $m --n 8192 --k 1024 \
      --graph 10 --repeats 30
  done
}
exp_s87() { # (prepared after the thirty-first session's device time) tw_gemm's rule to m 128?
  local m shape
  for m in 96 128; do
    for shape in "--n 4096 --k 4096" "--n 8192 --k 4096" "--n 28672 --k 8192" "--n 1024 --k 8192" \
      "--n 16384 --k 2048"; do
      # shellcheck disable=SC2086
      run "s87-gemm-graph-m$m${shape// /}" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_ROUNDS=5 \
        "$bin/tw-bench" gemm --m $m $shape --repeats 50 --warmup 5
    done
  done
  run "s87-gemm_ar-8v-m128" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_GEMM_SWAP=-1,1 \
    "$bin/tw-bench" gemm_ar --world 8 --m 128 --n 8192 --k 1024 --repeats 40 --warmup 10
  [ "$ngpus" -gt 1 ] || return 0
  run "s87-ag_gemm-m128-swap" 90 env TW_BENCH_GRAPH=1 TW_BENCH_BLOCK=10 TW_BENCH_ROUNDS=5 \
    TW_BENCH_AB=TW_GEMM_SWAP=-1,1 "$bin/tw-bench" ag_gemm --world 2 --m 128 --n 1024 --k 8192 \
    --repeats 40 --warmup 10
}
exp_s86() { # s85: swapped through the area, GEMM+RS bf16 partials at M=128 0.0194 ms against
  # NCCL bf16 + torch's 0.0208 (0.0233 unswapped); now the pipeline's rule
  run "s86-test_gemm_rs" 200 "$bin/test_gemm_rs"
  run "s86-memcheck-test_gemm_rs-small" 200 compute-sanitizer --tool memcheck --error-exitcode=1 \
    "$bin/test_gemm_rs" --small
  [ "$ngpus" -gt 1 ] || return 0
  run "s86-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  dist_decode s86 128 64
}
exp_s85() { # GEMM+RS with bf16 partials at M=128 trails NCCL bf16 + torch (s83: 0.0232 against
  # 0.0208 ms): 128-row tiles there fill half the SMs and the words leave after the GEMM
  run "s85-test_gemm" 120 "$bin/test_gemm"
  run "s85-test_gemm_rs" 200 "$bin/test_gemm_rs"
  local m v
  for m in 128 96; do
    run "s85-gemm-graph-m$m" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_ROUNDS=5 "$bin/tw-bench" gemm \
      --m $m --n 8192 --k 1024 --repeats 50 --warmup 5
  done
  [ "$ngpus" -gt 1 ] || return 0
  run "s85-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for v in default swap1-area swap2-area swap1-pull swap1-pull swap2-area swap1-area default; do
    local e=()
    case $v in
    swap1-area) e=(TW_GEMM_SWAP=1 TW_RS_UNFUSED_LL=1) ;;
    swap2-area) e=(TW_GEMM_SWAP=2 TW_RS_UNFUSED_LL=1) ;;
    swap1-pull) e=(TW_GEMM_SWAP=1) ;;
    esac
    run "s85-dist-m128-$v" 120 env "${e[@]}" TILEWIRE_LIB="$root/$bin/libtilewire.so" \
      PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op gemm_rs --op gemm_ar \
      --m 128 --n 8192 --k 1024 --graph 10 --repeats 30
  done
}
exp_s84() { # the decode rows with the line layout and the area's new rule (2 GPUs only)
  [ "$ngpus" -gt 1 ] || return 0
  dist_decode s84 64 16
  decode_block10 s84
}
exp_s83() { # the area's rules on the line layout (s82: fp32 M=64, 2 MiB a peer, through the area
  # GEMM+RS 0.0213 -> 0.0190 ms, GEMM+AR 0.0249 -> 0.0220); 2 GPUs only
  [ "$ngpus" -gt 1 ] || return 0
  local a m p
  for a in "128 1 500 1" "128 4 200 1"; do
    # shellcheck disable=SC2086
    run "s83-llbench-${a// /-}" 60 "$bin/tw-llbench" $a
  done
  for m in 128 256; do
    for p in 1 -1 -1 1; do
      run "s83-dist-m$m-area$p" 120 env TW_RS_UNFUSED_LL=$p \
        TILEWIRE_LIB="$root/$bin/libtilewire.so" PYTHONPATH="$root/python" python3 -m \
        tilewire.bench_dist --nproc 2 --op gemm_rs --op gemm_ar --m $m --n 8192 --k 1024 \
        --graph 10 --repeats 30
    done
    run "s83-ag_gemm-m$m-agll" 90 env TW_BENCH_GRAPH=1 TW_BENCH_BLOCK=10 TW_BENCH_ROUNDS=5 \
      TW_BENCH_AB=TW_AG_LL=-1,1 "$bin/tw-bench" ag_gemm --world 2 --m $m --n 1024 --k 8192 \
      --repeats 40 --warmup 10
  done
}
exp_s82() { # the low-latency words 8 items' first words a line (llbench, s81: 1.51 against 2.16
  # us one way at 512 KiB); the same bits, so the tests as they are
  run "s82-test_gemm_rs" 200 "$bin/test_gemm_rs"
  run "s82-test_allgather" 100 "$bin/test_allgather"
  run "s82-test_ag_gemm" 100 "$bin/test_ag_gemm"
  run "s82-memcheck-test_gemm_rs-small" 200 compute-sanitizer --tool memcheck --error-exitcode=1 \
    "$bin/test_gemm_rs" --small
  run "s82-memcheck-test_allgather-small" 100 compute-sanitizer --tool memcheck \
    --error-exitcode=1 "$bin/test_allgather" --small
  [ "$ngpus" -gt 1 ] || return 0
  local d
  for d in test_gemm_rs test_allgather test_ag_gemm; do
    run "s82-$d-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/$d"
  done
  local m p
  for m in 64 16; do
    dist_new_old "s82-dist-m$m" 120 --op gemm_rs --op gemm_ar --m $m --n 8192 --k 1024 \
      --graph 10 --repeats 30
  done
  dist_new_old "s82-dist-ag-m64" 120 --op ag_gemm --m 64 --n 1024 --k 8192 --graph 10 --repeats 30
  for p in 0 1 1 0; do
    run "s82-dist-m64-reduce$p" 120 env TW_RS_LL_REDUCE=$p TILEWIRE_LIB="$root/$bin/libtilewire.so" \
      PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op gemm_rs --m 64 \
      --n 8192 --k 1024 --graph 10 --repeats 30
  done
  for p in 1 -1 -1 1; do
    run "s82-dist-m64-area$p" 120 env TW_RS_UNFUSED_LL=$p TILEWIRE_LIB="$root/$bin/libtilewire.so" \
      PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op gemm_rs --op gemm_ar \
      --m 64 --n 8192 --k 1024 --graph 10 --repeats 30
  done
}
exp_s81() { # the words' layout over NVLink (tools/micro/llbench.cu): one round trip carries
  # the payload both ways; args: ctas items-per-thread rounds jump (1: the swap-AB tile's rows)
  local a
  for a in "128 1 500 1" "128 1 500 0" "32 1 500 1" "128 4 200 1" "1 1 500 0"; do
    # shellcheck disable=SC2086
    run "s81-llbench-${a// /-}" 60 "$bin/tw-llbench" $a
  done
}
exp_s80() { # (b29e598, prepared after the thirtieth session's device time) test_stall's new case:
  # tw_gemm_rs at m 16 through the GEMM epilogue's own-row sums (TW_RS_LL_REDUCE=1) with a peer
  # that never calls must give up after TW_WAIT_TIMEOUT_MS, be reported and name the peer
  run "s80-test_stall" 300 "$bin/test_stall"
  [ "$ngpus" -gt 1 ] && run "s80-test_stall-distinct" 300 env TW_TEST_DEVICES=distinct \
    "$bin/test_stall"
}
exp_s79() { # (TW_RS_LL_REDUCE, default 0) the decode GEMM+RS with bf16 partials one process per
  # GPU from graphs: 0.0166-0.0168 ms against NCCL bf16 + torch's 0.0159-0.0160 (s74, s77). With
  # the knob the GEMM's epilogue sums its own rows (no own-row words, no reduce grid)
  run "s79-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] && run "s79-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct \
    "$bin/test_gemm_rs"
  run "s79-memcheck-test_gemm_rs-small" 200 compute-sanitizer --tool memcheck --error-exitcode=1 \
    "$bin/test_gemm_rs" --small
  local m g p
  if [ "$ngpus" -gt 1 ]; then
    for m in 64 16; do
      for g in 0 1; do
        run "s79-gemm_rs-m$m-graph$g" 90 env TW_BENCH_GRAPH=$g TW_BENCH_BLOCK=$((g ? 10 : 1)) \
          TW_BENCH_AB=TW_RS_LL_REDUCE=0,1 "$bin/tw-bench" gemm_rs --world 2 --m $m --n 8192 \
          --k 1024 --repeats 40 --warmup 10
      done
    done
    for m in 64 16; do
      for p in 0 1 1 0; do
        run "s79-bench_dist-graph-m$m-reduce$p" 120 env TW_RS_LL_REDUCE=$p \
          TILEWIRE_LIB="$root/$bin/libtilewire.so" PYTHONPATH="$root/python" python3 -m \
          tilewire.bench_dist --nproc 2 --op gemm_rs --m $m --n 8192 --k 1024 --graph 10 \
          --repeats 30
      done
    done
  fi
  run "s79-gemm_rs-8v-m64" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_LL_REDUCE=0,1 \
    "$bin/tw-bench" gemm_rs --world 8 --m 64 --n 8192 --k 1024 --repeats 40 --warmup 10
}
exp_s78() { # (2 GPUs) s73 / s77: from graphs with one process driving both GPUs, every row
  # (NCCL's too) pays the bench's cross-GPU fork and join on every call, and the in-call decode
  # rows read slower than eager (GEMM+AR bf16p M=64 0.0356 against 0.0309 ms). With 10 calls a
  # rank between one fork and join (TW_BENCH_BLOCK=10) the graph times the ranks' streams
  # running calls back to back, as a training or serving step does; 5 interleaved rounds
  [ "$ngpus" -gt 1 ] || return 0
  decode_block10 s78
  # where the decode call's time goes after the GEMM: the low-latency reduce kernel's stamps
  run "s78-trace-gemm_rs-m64" 60 env TW_TRACE=1 TW_BENCH_WARM_MS=0 "$bin/tw-bench" gemm_rs \
    --world 2 --m 64 --n 8192 --k 1024 --repeats 5 --warmup 2
}
exp_s77() { # (15c1348: swap-AB's 64-row tiles on CTA pairs, TW_GEMM_SWAP_PAIR, default 0;
  # measured 11-23% slower and taken out again, so on later commits the pair rows fail) the
  # decode GEMM core at 1.05x cuBLAS (0.0076 against 0.0072 ms at M=64 N=8192 K=1024); cuBLAS's
  # decode kernels run clusters that share the tokens by multicast. Tests first, then tw_gemm
  # from graphs (tilewire-swap64 against tilewire-swap64-pair in the same rounds), the decode
  # pipelines with the knob interleaved, one process per GPU alternated; last, the reduce
  # kernel's one store loop against HEAD's gemm_rs_sm90.cu (diagold/) on 8 virtual ranks
  run "s77-test_gemm" 120 "$bin/test_gemm"
  run "s77-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] && run "s77-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct \
    "$bin/test_gemm_rs"
  run "s77-memcheck-test_gemm_rs-small" 200 compute-sanitizer --tool memcheck --error-exitcode=1 \
    "$bin/test_gemm_rs" --small
  local shape
  for shape in "--m 64 --n 8192 --k 1024" "--m 16 --n 8192 --k 1024" "--m 64 --n 8192 --k 3584" \
    "--m 16 --n 4096 --k 4096" "--m 32 --n 4096 --k 1024"; do
    run "s77-gemm-graph-${shape// /}" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_ROUNDS=5 \
      "$bin/tw-bench" gemm $shape --repeats 50 --warmup 5
  done
  if [ "$ngpus" -gt 1 ]; then
    local op m g
    for op in gemm_rs gemm_ar; do
      for m in 64 16; do
        for g in 1 0; do
          run "s77-$op-m$m-graph$g-pair" 90 env TW_BENCH_GRAPH=$g TW_BENCH_AB=TW_GEMM_SWAP_PAIR=0,1 \
            "$bin/tw-bench" $op --world 2 --m $m --n 8192 --k 1024 --repeats 40 --warmup 10
        done
      done
    done
    local p
    for p in 0 1 1 0; do
      run "s77-bench_dist-graph-m64-pair$p" 120 env TW_GEMM_SWAP_PAIR=$p \
        TILEWIRE_LIB="$root/$bin/libtilewire.so" PYTHONPATH="$root/python" python3 -m \
        tilewire.bench_dist --nproc 2 --op gemm_ar --op gemm_rs --m 64 --n 8192 --k 1024 \
        --graph 10 --repeats 30
    done
  fi
  run_new_old "s77-gemm_ar-8v-quick-graph" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 \
    "$bin/tw-bench" gemm_ar --world 8 --m 1024 --n 1024 --k 256 --repeats 30 --warmup 5
  run_new_old "s77-gemm_rs-8v-m4096" 90 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_rs --world 8 \
    --m 4096 --n 4096 --k 512 --repeats 20 --warmup 5
}
exp_s76() { # (main + TW_RS_UNFUSED_CTAS as a count past the rank's SM budget; dropped: the
  # ranks' kernels must all be resident, and 8 x 128 waiting CTAs were not) s75 found the
  # in-call reduce kernel's rate on the path (fewer CTAs slower at every step): more than the
  # rank's 16, from graphs and eager, at the --quick shape and M=4096 K 512; a test with 128
  run "s76-test_gemm_rs-ctas128" 200 env TW_RS_UNFUSED_CTAS=128 "$bin/test_gemm_rs"
  local ab g
  for g in 1 0; do
    for ab in 0,32,64,128 128,64,32,0; do
      run "s76-gemm_ar-8v-m1024-graph$g-ctas$ab" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=$g \
        TW_BENCH_AB=TW_RS_UNFUSED_CTAS=$ab "$bin/tw-bench" gemm_ar --world 8 --m 1024 --n 1024 \
        --k 256 --repeats 30 --warmup 5
    done
    run "s76-gemm_ar-8v-m4096-graph$g" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=$g \
      TW_BENCH_AB=TW_RS_UNFUSED_CTAS=0,32,64 "$bin/tw-bench" gemm_ar --world 8 --m 4096 \
      --n 4096 --k 512 --repeats 20 --warmup 5
  done
}
exp_s75() { # (main + TW_RS_UNFUSED_CTAS, a cap on the in-call reduce grid; dropped: fewer CTAs
  # were slower) s67's reading, tested: if the in-call reduce kernels'
  # waiting CTAs (16 a rank) hold the SMs the later ranks' GEMMs need, fewer of them should take
  # the --quick GEMM+AR from graphs (0.083 ms) toward the separate calls' 0.054
  run "s75-test_gemm_rs-ctas2" 200 env TW_RS_UNFUSED_CTAS=2 "$bin/test_gemm_rs"
  local ab g
  for g in 1 0; do
    for ab in 0,1,2,4,8 8,4,2,1,0; do
      run "s75-gemm_ar-8v-m1024-graph$g-ctas$ab" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=$g \
        TW_BENCH_AB=TW_RS_UNFUSED_CTAS=$ab "$bin/tw-bench" gemm_ar --world 8 --m 1024 --n 1024 \
        --k 256 --repeats 30 --warmup 5
    done
  done
  run "s75-gemm_ar-8v-m4096-graph1" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 \
    TW_BENCH_AB=TW_RS_UNFUSED_CTAS=0,2,4 "$bin/tw-bench" gemm_ar --world 8 --m 4096 --n 4096 \
    --k 512 --repeats 20 --warmup 5
}
exp_s74() { # (c6bcbf1, 2 GPUs) s73, one process driving both GPUs from graphs: GEMM+AR with
  # bf16 partials at M=64 0.034-0.036 ms against NCCL bf16 + cuBLAS 0.030. The setting a
  # PyTorch server has: one process per GPU, replays of 10 captured calls, M=16 and 64, twice
  [ "$ngpus" -gt 1 ] || return 0
  local i m
  for i in 1 2; do
    for m in 16 64; do
      run "s74-bench_dist-graph-m$m-$i" 120 env TILEWIRE_LIB="$root/$bin/libtilewire.so" \
        PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op gemm_ar \
        --op gemm_rs --m $m --n 8192 --k 1024 --graph 10 --repeats 30
    done
  done
}
exp_s73() { # (c6bcbf1, 2 GPUs) s71: GEMM+AR with bf16 partials at decode, the call 0.0305-0.0311
  # ms eager against the same kernels as separate calls 0.0270-0.0274. From graphs (GPU time
  # only: is it the host's launches?), 5 interleaved rounds; then the low-latency area, its
  # epilogue and PDL as interleaved knob rows, eager and from graphs
  [ "$ngpus" -gt 1 ] || return 0
  local g ab
  for g in 0 1; do
    run "s73-gemm_ar-decode-graph$g" 90 env TW_BENCH_GRAPH=$g TW_BENCH_ROUNDS=5 "$bin/tw-bench" \
      gemm_ar --world 2 --m 64 --n 8192 --k 1024 --repeats 40 --warmup 10
    for ab in TW_RS_UNFUSED_LL=-1,0 TW_RS_LL_EPI=1,0 TW_RS_UNFUSED_PDL=1,0; do
      run "s73-gemm_ar-decode-graph$g-${ab%%=*}" 90 env TW_BENCH_GRAPH=$g TW_BENCH_AB=$ab \
        "$bin/tw-bench" gemm_ar --world 2 --m 64 --n 8192 --k 1024 --repeats 40 --warmup 10
    done
  done
}
exp_s72() { # (c6bcbf1) issue 4's world-1 target (within 3% of the GEMM alone): the suite's
  # single round read fused 0.0348 against 0.0338 ms at M=4096 N=512 (spreads 3-4%); every row
  # of the issue's shapes in 5 interleaved rounds, twice
  local i
  for i in 1 2; do
    run "s72-ag_gemm-w1-r5-$i" 120 env TW_BENCH_ROUNDS=5 "$bin/tw-bench" ag_gemm --world 1 \
      --repeats 20 --warmup 5
  done
}
exp_s71() { # (c6bcbf1, 2 GPUs) the suite's 20-repeat decode rows spread 10-88% (p10-p90 of the
  # median); GEMM+AR bf16p-outsym read 0.0551 ms, 0.73x of NCCL bf16 + cuBLAS: every row in 5
  # interleaved rounds of 40 calls, twice per op
  [ "$ngpus" -gt 1 ] || return 0
  local i op
  for i in 1 2; do
    for op in gemm_ar gemm_rs; do
      run "s71-$op-decode-r5-$i" 90 env TW_BENCH_ROUNDS=5 "$bin/tw-bench" $op --world 2 --m 64 \
        --n 8192 --k 1024 --repeats 40 --warmup 10
    done
  done
}
exp_s70() { # (c6bcbf1) the suite's TW_RS_STEAL=0 step on 8 virtual ranks had tilewire-bf16p at
  # 0.723 / 4.967 / 22.55 ms (M=4096 / 8192 / 16384) against fp32's 0.540 / 2.960 / 19.48: the
  # new build against f106895's gemm_rs_sm90.cu (diagold/), alternated, both orders
  local m
  for m in 8192 4096; do
    run_new_old "s70-gemm_rs-8v-steal0-m$m" 90 env TW_BENCH_VIRTUAL=1 TW_RS_STEAL=0 \
      "$bin/tw-bench" gemm_rs --world 8 --m $m --n $m --k $((m / 8)) --repeats 20 --warmup 5
  done
}
exp_s69() { # (main) issue 4's last target: tw_ag_gemm with the gathered output on 8 virtual
  # ranks at M=16384, 5 interleaved rounds a run (s63 gave 0.95 / 0.93), four runs
  local i
  for i in 1 2 3 4; do
    run "s69-ag_gemm-8v-m16384-r5-$i" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_ROUNDS=5 \
      "$bin/tw-bench" ag_gemm --world 8 --m 16384 --n 2048 --k 16384 --repeats 6 --warmup 2
  done
}
exp_s68() { # (main + one item-position helper for reduce_unit and gather_unit: the division
  # path stores at the row and column it loaded from, no 64-bit division) test_gemm_rs, then
  # the new build against f106895's gemm_rs_sm90.cu (diagold/, scripts/diag-lib.sh 0 with the
  # old file), alternated, on 2 GPUs (8 virtual ranks on one): the bf16p rows take the path
  run "s68-test_gemm_rs" 300 "$bin/test_gemm_rs"
  local w=2 v=
  [ "$ngpus" -gt 1 ] || w=8 v=1
  run_new_old "s68-gemm_rs-flux" 90 env TW_BENCH_VIRTUAL=$v "$bin/tw-bench" gemm_rs --world $w \
    $flux_rs --repeats 20 --warmup 5
  run_new_old "s68-gemm_ar-flux" 90 env TW_BENCH_VIRTUAL=$v "$bin/tw-bench" gemm_ar --world $w \
    $flux_rs --repeats 20 --warmup 5
  run_new_old "s68-gemm_ar-big" 90 env TW_BENCH_VIRTUAL=$v "$bin/tw-bench" gemm_ar --world $w \
    $big_rs --repeats 10 --warmup 3
}
exp_s67() { # (main) tw_gemm_ar's unfused pipeline inside the call against the same kernels as
  # separate calls on 8 virtual ranks at M=1024 N=1024 K 256 from graphs: 0.083 against
  # 0.054-0.059 ms (twenty-eighth session). Where the ~25 us go: TW_TRACE of the in-call calls
  # (the reduce kernel's start / end stamps per rank), eager and from graphs; nsys if the
  # machine has it (kernel gaps per rank's stream)
  local mode
  for mode in eager graph; do
    local g=0
    [ $mode = graph ] && g=1
    run "s67-trace-gemm_ar-8v-m1024-$mode" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=$g TW_TRACE=1 \
      TW_BENCH_WARM_MS=0 "$bin/tw-bench" gemm_ar --world 8 --m 1024 --n 1024 --k 256 --repeats 10 \
      --warmup 3 --no-check
  done
  if command -v nsys >/dev/null 2>&1; then
    run "s67-nsys-gemm_ar-8v-m1024" 120 nsys profile -o "$out/logs/s67-m1024" --force-overwrite \
      true env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 TW_BENCH_WARM_MS=0 "$bin/tw-bench" gemm_ar \
      --world 8 --m 1024 --n 1024 --k 256 --repeats 10 --warmup 3 --no-check
    nsys stats --report cuda_gpu_trace "$out/logs/s67-m1024.nsys-rep" >"$out/logs/s67-nsys-trace.txt" \
      2>&1 || true
  fi
}
exp_s66() { # (main + no low-latency area for tw_gemm_ar into every rank's out where ranks share
  # a GPU) 8 virtual ranks: the new rule (-1) against the area (TW_RS_UNFUSED_LL=1, the old
  # choice where the rows fit) from graphs and eager, at the --quick shape and decode M=64; the
  # unfused pipeline's release wait in a kernel of its own (open item of s65); tests
  local ll sh
  run "s66-test_gemm_rs" 200 "$bin/test_gemm_rs"
  run "s66-memcheck-test_gemm_rs" 150 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm_rs" --small
  for sh in "1024 1024 256" "64 8192 1024"; do
    set -- $sh
    for ll in -1 1; do
      run "s66-gemm_ar-8v-m$1-graph-ll$ll" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 \
        TW_RS_UNFUSED_LL=$ll "$bin/tw-bench" gemm_ar --world 8 --m $1 --n $2 --k $3 --repeats 30 \
        --warmup 5
    done
    for ll in -1,1 1,-1; do
      run "s66-gemm_ar-8v-m$1-eager-ll$ll" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
        TW_BENCH_AB=TW_RS_UNFUSED_LL=$ll "$bin/tw-bench" gemm_ar --world 8 --m $1 --n $2 --k $3 \
        --repeats 30 --warmup 5
    done
  done
  run "s66-gemm_ar-8v-m1024-graph-waitkernel" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 \
    TW_RS_UNFUSED_WAIT_KERNEL=1 "$bin/tw-bench" gemm_ar --world 8 --m 1024 --n 1024 --k 256 \
    --repeats 30 --warmup 5
}
exp_s65() { # (main + the shared-GPU rule for tw_gemm_ar at m <= 4096, K <= 2048) tests and
  # the --quick rows from graphs and eager on 8 virtual ranks; memcheck of test_gemm_rs --small
  local op
  run "s65-test_gemm_rs" 200 "$bin/test_gemm_rs"
  run "s65-memcheck-test_gemm_rs" 150 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm_rs" --small
  run "s65-gemm_ar-8v-quick-graph" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 "$bin/tw-bench" \
    gemm_ar --quick --repeats 20 --warmup 5
  run "s65-gemm_ar-8v-quick" 90 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_ar --quick \
    --repeats 20 --warmup 5
  run "s65-gemm_ar-8v-m1024-n8192-k2048" 90 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_ar \
    --world 8 --m 1024 --n 8192 --k 2048 --repeats 20 --warmup 5
}
exp_s64() { # (main, one GPU) 8 virtual ranks between decode and m 4096, where the shared-GPU
  # rule has not been measured: the suite's --quick row (M=1024 N=1024 K 256, from graphs) ran
  # GEMM+AR fused 0.109 ms against tilewire's unfused pipeline's 0.050. The rule (-1) against
  # the unfused pipeline in the call (1), both orders, eager; then the quick shapes from graphs
  # with the unfused pipeline forced (the tilewire rows then are it). Last, the two memchecks
  # the twenty-eighth session's suite left to its deadline.
  local op shape ab
  for shape in "1024 1024 256" "1024 8192 2048" "2048 4096 512" "512 8192 1024" "2048 2048 2048"; do
    set -- $shape
    for op in gemm_ar gemm_rs; do
      for ab in -1,1 1,-1; do
        run "s64-$op-8v-m$1-n$2-k$3-$ab" 90 env TW_BENCH_VIRTUAL=1 \
          TW_BENCH_AB=TW_RS_UNFUSED_SMALL=$ab "$bin/tw-bench" $op --world 8 --m $1 --n $2 --k $3 \
          --repeats 20 --warmup 5
      done
    done
  done
  for op in gemm_ar gemm_rs; do
    run "s64-$op-8v-quick-graph" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 "$bin/tw-bench" $op \
      --quick --repeats 20 --warmup 5
    run "s64-$op-8v-quick-graph-unfused" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 \
      TW_RS_UNFUSED_SMALL=1 "$bin/tw-bench" $op --quick --repeats 20 --warmup 5
  done
  run "s64-memcheck-test_ag_gemm" 150 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_ag_gemm" --small
  run "s64-memcheck-test_gemm_rs" 150 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm_rs" --small
}
exp_s63() { # (main) 8 virtual ranks at M=16384, the overlap's spread: every main row timed in
  # 5 interleaved rounds (TW_BENCH_ROUNDS), twice per op, so the fused op and the GEMM alone
  # see the card's drift alike (single runs gave GEMM+AR 0.86-0.93, ag_gemm 0.80-0.87)
  local op i
  for i in 1 2; do
    for op in gemm_ar gemm_rs; do
      run "s63-$op-8v-m16384-r5-$i" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_ROUNDS=5 \
        "$bin/tw-bench" $op --world 8 $big_rs --repeats 6 --warmup 2
    done
    run "s63-ag_gemm-8v-m16384-r5-$i" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_ROUNDS=5 \
      "$bin/tw-bench" ag_gemm --world 8 --m 16384 --n 2048 --k 16384 --repeats 6 --warmup 2
  done
}
exp_s62() { # (main, 2 GPUs) s60's lead, interleaved: more reduce CTAs for bf16 partials at
  # M=16384 (GEMM+AR's plan: 9, GEMM+RS's: 5) and at flux-tp8 (4 and 3), both orders. The
  # fp32 rows of GEMM+AR at M=16384 run the owner epilogue (no reduce CTAs): a control.
  [ "$ngpus" -gt 1 ] || return 0
  local ab
  for ab in -1,16,24 24,16,-1; do
    run "s62-gemm_ar-big-red$ab" 150 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab "$bin/tw-bench" \
      gemm_ar --world 2 $big_rs --repeats 10 --warmup 3
  done
  for ab in -1,8,16 16,8,-1; do
    run "s62-gemm_rs-big-red$ab" 150 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab "$bin/tw-bench" \
      gemm_rs --world 2 $big_rs --repeats 10 --warmup 3
  done
  for ab in -1,8 8,-1; do
    run "s62-gemm_ar-flux-red$ab" 90 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab "$bin/tw-bench" \
      gemm_ar --world 2 $flux_rs --repeats 20 --warmup 5
  done
}
exp_s61() { # (main, 2 GPUs) s60's tilewire-bf16p row of GEMM+RS at flux-tp8 ran 1.29-1.34 ms
  # after the reduce-CTA rows, 1.07 without them: is it the rows before it, or the count (3)?
  [ "$ngpus" -gt 1 ] || return 0
  local l
  run "s61-gemm_rs-flux-plain" 60 "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 20 --warmup 5
  for l in 3 4 48 3,48; do
    run "s61-gemm_rs-flux-bf16p-red$l" 60 env TW_BENCH_RS_SWEEP_BF16=1 TW_BENCH_RS_REDUCE_SMS=$l \
      "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 20 --warmup 5
  done
  run "s61-gemm_rs-flux-plain-again" 60 "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 20 \
    --warmup 5
  run "s61-trace-gemm_rs-flux-bf16p-red48" 60 env TW_TRACE=1 TW_BENCH_STAMPS=1 \
    TW_BENCH_RS_SWEEP_BF16=1 TW_BENCH_RS_REDUCE_SMS=48 "$bin/tw-bench" gemm_rs --world 2 $flux_rs \
    --repeats 10 --warmup 3
}
exp_s60() { # (main, 2 GPUs) bf16 partials at M=16384 and flux-tp8: the reduce CTAs' count
  # (TW_BENCH_RS_REDUCE_SMS rows, both orders). The twenty-eighth session's trace of GEMM+AR
  # bf16p at M=16384: the GEMM phase at the GEMM alone's 1.70 ms, 9 reduce CTAs reduced a third
  # of the groups by then, and the rest (reduction + gather over NVLink) is a 0.67 ms tail
  local op shape
  [ "$ngpus" -gt 1 ] || return 0
  for op in gemm_ar gemm_rs; do
    for shape in big flux; do
      local args=$big_rs
      [ $shape = flux ] && args=$flux_rs
      run "s60-$op-$shape-bf16p-red-up" 120 env TW_BENCH_RS_SWEEP_BF16=1 \
        TW_BENCH_RS_REDUCE_SMS=4,8,16,24,32,48 "$bin/tw-bench" $op --world 2 $args --repeats 20 \
        --warmup 5
      run "s60-$op-$shape-bf16p-red-down" 120 env TW_BENCH_RS_SWEEP_BF16=1 \
        TW_BENCH_RS_REDUCE_SMS=48,32,24,16,8,4 "$bin/tw-bench" $op --world 2 $args --repeats 20 \
        --warmup 5
    done
  done
  run "s60-trace-gemm_ar-big-red32" 90 env TW_TRACE=1 TW_BENCH_STAMPS=1 TW_RS_REDUCE_CTAS=32 \
    "$bin/tw-bench" gemm_ar --world 2 $big_rs --repeats 10 --warmup 3
}
exp_s59() { # (exp/evict; the knob since removed: measured level) the partials' TMA stores with
  # an L2 evict-first policy (TW_RS_STORE_EVICT=1) against none: tests on both placements, A/B
  # both orders at flux-tp8 (2 GPUs), M=16384; main's library (build-main/, packed beside) at
  # flux-tp8 for the default's cost (the hinted store with a zero fraction)
  rs_ab_flux s59 TW_RS_STORE_EVICT 0 1
  [ "$ngpus" -gt 1 ] || return 0
  [ -x build-main/tw-bench ] && run "s59-gemm_rs-flux-main" 90 env \
    LD_LIBRARY_PATH="$root/build-main:${LD_LIBRARY_PATH:-}" build-main/tw-bench gemm_rs --world 2 \
    $flux_rs --repeats 20 --warmup 5
  rs_ab_big s59 TW_RS_STORE_EVICT 0,1
}
exp_s58() { # (main, 2 GPUs) SM clock and power per variant at flux-tp8, GEMM+RS and GEMM+AR:
  # does the fused kernel wait (clock up, power down, as the fourth session found at M=16384)
  # or run at the power limit like the GEMM alone?
  local op
  [ "$ngpus" -gt 1 ] || return 0
  for op in gemm_rs gemm_ar; do
    clocks "s58-clocks-$op-flux" "$bin/tw-bench" $op --world 2 $flux_rs --repeats 400 --warmup 5
  done
}
exp_s57() { # (main) 8 virtual ranks at M=16384: tw_ag_gemm's communication CTAs (0: the plan),
  # and repeats of GEMM+AR / GEMM+RS for their overlap's spread
  local i
  run "s57-ag_gemm-8v-m16384-comm" 150 env TW_BENCH_VIRTUAL=1 \
    TW_BENCH_AB=TW_AG_COMM_SMS=0,2,4,6,3 "$bin/tw-bench" ag_gemm --world 8 --m 16384 \
    --n 2048 --k 16384 --repeats 5 --warmup 2
  for i in 1 2; do
    run "s57-gemm_ar-8v-m16384-$i" 150 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_ar --world 8 \
      $big_rs --repeats 5 --warmup 2
  done
  run "s57-gemm_rs-8v-m16384" 150 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_rs --world 8 \
    $big_rs --repeats 5 --warmup 2
}
exp_s56() { # (main with the short-K rule to K 2048) the rule (-1) against the fused kernel (0)
  # on 8 virtual ranks at M=16384 K 2048, symmetric-output rows too
  local op
  for op in gemm_ar gemm_rs; do
    run "s56-$op-8v-m16384-unf-1,0" 150 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
      TW_BENCH_AB=TW_RS_UNFUSED_SMALL=-1,0 "$bin/tw-bench" $op --world 8 $big_rs --repeats 5 \
      --warmup 2
  done
}
exp_s55() { # (main with peer outs) where ranks share a GPU past the short-K rule: the in-call
  # unfused pipeline (TW_RS_UNFUSED_SMALL=1) against the fused kernel (0) on 8 virtual ranks at
  # M=16384 K 2048 and flux-tp8, both orders at M=16384, symmetric-output rows too; memcheck of
  # test_gemm_rs --small (the peer-out stores)
  local op ab
  run "s55-memcheck-test_gemm_rs" 300 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm_rs" --small
  for op in gemm_ar gemm_rs; do
    for ab in 0,1 1,0; do
      run "s55-$op-8v-m16384-unf$ab" 150 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
        TW_BENCH_AB=TW_RS_UNFUSED_SMALL=$ab "$bin/tw-bench" $op --world 8 $big_rs --repeats 5 \
        --warmup 2
    done
    run "s55-$op-8v-flux-unf0,1" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
      TW_BENCH_AB=TW_RS_UNFUSED_SMALL=0,1 "$bin/tw-bench" $op --world 8 $flux_rs --repeats 10 \
      --warmup 3
  done
}
exp_s54() { # (docs/patches/rs-bf16-deep.patch applied) bf16 partials reduced with 8 items in
  # flight a thread (TW_RS_BF16_DEEP=1) against 4: tests, traces and A/B at flux-tp8 (2 GPUs)
  local op v tests=1
  # With both patches applied, s53's test_gemm_rs runs carry this patch's case too.
  [ -f "$out/logs/s53-test_gemm_rs.log" ] && tests=0
  [ $tests = 1 ] && run "s54-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || {
    run "s54-gemm_rs-2v-flux-red4-0,1" 120 env TW_BENCH_VIRTUAL=1 TW_RS_REDUCE_CTAS=4 \
      TW_BENCH_AB=TW_RS_BF16_DEEP=0,1 "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 20 \
      --warmup 5
    return 0
  }
  [ $tests = 1 ] && run "s54-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for op in gemm_rs gemm_ar; do
    for v in 0,1 1,0; do
      run "s54-$op-flux-$v" 90 env TW_BENCH_AB=TW_RS_BF16_DEEP=$v "$bin/tw-bench" $op --world 2 \
        $flux_rs --repeats 20 --warmup 5
    done
  done
  for v in 0 1; do
    run "s54-trace-gemm_rs-flux-deep$v" 90 env TW_TRACE=1 TW_RS_BF16_DEEP=$v "$bin/tw-bench" \
      gemm_rs --world 2 $flux_rs --repeats 4 --warmup 2
  done
  rs_ab_big s54 TW_RS_BF16_DEEP 0,1
}
exp_s53() { # (docs/patches/ar-peer-out.patch applied) tw_gemm_ar into plain outs on virtual
  # ranks: the unfused pipeline stores into the peers' outs (TW_AR_PEER_OUT=-1) against the
  # gather copy / the fused kernel (0)
  local ab
  run "s53-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] &&
    run "s53-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for ab in -1,0 0,-1; do
    run "s53-gemm_ar-8v-m4096-po$ab" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_AR_PEER_OUT=$ab \
      "$bin/tw-bench" gemm_ar --world 8 --m 4096 --n 4096 --k 512 --repeats 20 --warmup 5
  done
  run "s53-gemm_ar-8v-m8192-po-1,0" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_AR_PEER_OUT=-1,0 \
    "$bin/tw-bench" gemm_ar --world 8 --m 8192 --n 8192 --k 1024 --repeats 10 --warmup 3
  # M=16384 K 2048: the unfused pipeline with peer outs (forced) against the fused kernel
  run "s53-gemm_ar-8v-m16384-unf0,1" 200 env TW_BENCH_VIRTUAL=1 \
    TW_BENCH_AB=TW_RS_UNFUSED_SMALL=0,1 "$bin/tw-bench" gemm_ar --world 8 --m 16384 --n 16384 \
    --k 2048 --repeats 5 --warmup 2
}
exp_s52() { # (main with the short-K rule where ranks share a GPU) the rule (-1) against the
  # fused kernel (0) on 8 virtual ranks, GEMM+RS and GEMM+AR (symmetric-output rows too)
  local op
  for op in gemm_rs gemm_ar; do
    run "s52-$op-8v-m4096-unf-1,0" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
      TW_BENCH_AB=TW_RS_UNFUSED_SMALL=-1,0 "$bin/tw-bench" $op --world 8 --m 4096 --n 4096 \
      --k 512 --repeats 20 --warmup 5
    run "s52-$op-8v-m8192-unf0,-1" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
      TW_BENCH_AB=TW_RS_UNFUSED_SMALL=0,-1 "$bin/tw-bench" $op --world 8 --m 8192 --n 8192 \
      --k 1024 --repeats 10 --warmup 3
  done
}
exp_s51() { # (main) the unfused pipeline inside the call where 8 ranks share a GPU, at the
  # sizes where the fused ops trail tilewire's own unfused pipeline (M=4096 K 512, M=8192 K 1024)
  local op ab
  for op in gemm_rs gemm_ar; do
    for ab in 0,1 1,0; do
      run "s51-$op-8v-m4096-unf$ab" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
        TW_BENCH_AB=TW_RS_UNFUSED_SMALL=$ab "$bin/tw-bench" $op --world 8 --m 4096 --n 4096 \
        --k 512 --repeats 20 --warmup 5
    done
    run "s51-$op-8v-m8192-unf0,1" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB_OUTSYM=1 \
      TW_BENCH_AB=TW_RS_UNFUSED_SMALL=0,1 "$bin/tw-bench" $op --world 8 --m 8192 --n 8192 \
      --k 1024 --repeats 10 --warmup 3
  done
}
exp_s49() { # (main) what a call costs when the ranks' calls run back to back
  # (TW_BENCH_BLOCK=8) against one fork/join per call, with traces; the reduce-CTA count
  local b
  [ "$ngpus" -gt 1 ] || return 0
  for b in 1 8; do
    run "s49-trace-gemm_rs-flux-block$b" 90 env TW_TRACE=1 TW_BENCH_BLOCK=$b "$bin/tw-bench" \
      gemm_rs --world 2 $flux_rs --repeats 4 --warmup 2
    run "s49-gemm_rs-flux-block$b" 90 env TW_BENCH_BLOCK=$b "$bin/tw-bench" gemm_rs --world 2 \
      $flux_rs --repeats 20 --warmup 5
  done
  for b in 4,8,0 0,8,4; do
    run "s49-gemm_rs-flux-red$b" 120 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$b "$bin/tw-bench" \
      gemm_rs --world 2 $flux_rs --repeats 20 --warmup 5
  done
  run "s49-gemm_ar-flux-red4,8,0" 120 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=4,8,0 "$bin/tw-bench" \
    gemm_ar --world 2 $flux_rs --repeats 20 --warmup 5
}
exp_s47() { # (exp/next34's build, 2 GPUs) the walk and the warp-granular groups at flux-tp8
  local op v ab
  rs_ab_flux s47 TW_RS_REDUCE_WALK 0 1
  [ "$ngpus" -gt 1 ] || return 0
  for v in 0 1; do
    run "s47-trace-gemm_rs-flux-walk$v" 90 env TW_TRACE=1 TW_RS_REDUCE_WALK=$v \
      "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 10 --warmup 3
  done
  for ab in gemm_rs:0,1 gemm_rs:1,0 gemm_ar:0,1; do
    run "s47-${ab%%:*}-flux-bw${ab#*:}" 90 env TW_BENCH_AB=TW_RS_REDUCE_BY_WARP=${ab#*:} \
      "$bin/tw-bench" ${ab%%:*} --world 2 $flux_rs --repeats 20 --warmup 5
  done
  run "s47-trace-gemm_rs-flux-bw1" 90 env TW_TRACE=1 TW_RS_REDUCE_BY_WARP=1 "$bin/tw-bench" \
    gemm_rs --world 2 $flux_rs --repeats 10 --warmup 3
  rs_ab_big s47 TW_RS_REDUCE_WALK 0,1
}
exp_s43() { # (branch exp/next33) ItemWalk (TW_RS_REDUCE_WALK=1, the default) against a
  # division per item (0): the micro-benchmark put the divisions at 44 against 76 GB/s a CTA
  # beside a GEMM, and flux-tp8's reduce CTAs ran at 25
  local op v ab
  if [ "$ngpus" -lt 2 ]; then
    run "s43-test_gemm_rs" 200 "$bin/test_gemm_rs"
    rs_tests_done=1 # rs_ab_flux's tests: done
    for ab in 0,1 1,0; do
      run "s43-gemm_rs-2v-flux-red4-$ab" 120 env TW_BENCH_VIRTUAL=1 TW_RS_REDUCE_CTAS=4 \
        TW_BENCH_AB=TW_RS_REDUCE_WALK=$ab "$bin/tw-bench" gemm_rs --world 2 $flux_rs \
        --repeats 20 --warmup 5
    done
    for v in 0 1; do
      run "s43-trace-gemm_rs-2v-flux-red4-walk$v" 90 env TW_TRACE=1 TW_RS_REDUCE_CTAS=4 \
        TW_RS_REDUCE_WALK=$v "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 5 --warmup 2
    done
  fi
  rs_ab_flux s43 TW_RS_REDUCE_WALK 0 1
  rs_ab_big s43 TW_RS_REDUCE_WALK 0,1
  if [ "$ngpus" -gt 1 ]; then
    for v in 0 1; do
      run "s43-trace-gemm_rs-flux-walk$v" 90 env TW_TRACE=1 TW_RS_REDUCE_WALK=$v \
        "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 10 --warmup 3
    done
  fi
  rs_ab_8v s43 TW_RS_REDUCE_WALK 0,1
}
exp_s42() { # main's TW_TRACE reduce counts (the register path; s41 ran them with the bulk code)
  run "s42-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s42-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  rs_traces s42 "-1 8"
}
# TW_TRACE=1 at flux-tp8 on 2 GPUs, GEMM+RS and GEMM+AR, for each reduce-CTA count:
# rs_traces PREFIX "COUNTS"
rs_traces() {
  local op n
  for op in gemm_rs gemm_ar; do
    for n in $2; do
      run "$1-trace-$op-flux-red$n" 90 env TW_TRACE=1 TW_RS_REDUCE_CTAS=$n "$bin/tw-bench" $op \
        --world 2 $flux_rs --repeats 10 --warmup 3
    done
  done
}
# test_gemm_rs on both placements (the first call of an invocation), then TW_BENCH_AB=KNOB=A,B
# and B,A at flux-tp8 for GEMM+RS and GEMM+AR on 2 GPUs: rs_ab_flux PREFIX KNOB A B
rs_ab_flux() {
  local pre=$1 knob=$2 a=$3 b=$4 op ab
  if [ -z "${rs_tests_done:-}" ]; then # once per invocation: every group here runs one build
    rs_tests_done=1
    run "$pre-test_gemm_rs" 200 "$bin/test_gemm_rs"
    [ "$ngpus" -gt 1 ] &&
      run "$pre-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  fi
  [ "$ngpus" -gt 1 ] || return 0
  for op in gemm_rs gemm_ar; do
    for ab in $a,$b $b,$a; do
      run "$pre-$op-flux-$ab" 90 env TW_BENCH_AB=$knob=$ab \
        "$bin/tw-bench" $op --world 2 $flux_rs --repeats 20 --warmup 5
    done
  done
}
# TW_BENCH_AB=KNOB=A,B for GEMM+RS and GEMM+AR on 2 GPUs at M=16384 with the reduce CTAs
# (TW_RS_OWNER_EPI=0): rs_ab_big PREFIX KNOB A,B
rs_ab_big() {
  local op
  [ "$ngpus" -gt 1 ] || return 0
  for op in gemm_rs gemm_ar; do
    run "$1-$op-m16384-epi0-$3" 120 env TW_RS_OWNER_EPI=0 TW_BENCH_AB=$2=$3 \
      "$bin/tw-bench" $op --world 2 $big_rs --repeats 10 --warmup 3
  done
}
# TW_BENCH_AB=KNOB=A,B for GEMM+RS and GEMM+AR on 8 virtual ranks at M=4096 K 512:
# rs_ab_8v PREFIX KNOB A,B
rs_ab_8v() {
  local op
  for op in gemm_rs gemm_ar; do
    run "$1-$op-8v-m4096-$3" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=$2=$3 \
      "$bin/tw-bench" $op --world 8 --m 4096 --n 4096 --k 512 --repeats 20 --warmup 5
  done
}
exp_s37() { # (twenty-fourth session; the knob since removed) 12 partial loads in flight per reducing thread
  # instead of 8 (TW_RS_REDUCE_LOADS=12): s35/s36 showed flux-tp8's 4 reduce CTAs trailing the
  # GEMM once they start (their one wait, about 180 us, is for the first group); tests on both
  # placements, A/B both orders at flux-tp8, M=16384 (bf16 partials take the reduce CTAs there),
  # a trace, and 8 virtual ranks at M=4096 K 512
  local op
  rs_ab_flux s37 TW_RS_REDUCE_LOADS 8 12
  if [ "$ngpus" -gt 1 ]; then
    for op in gemm_rs gemm_ar; do
      run "s37-$op-m16384-ld8,12" 120 env TW_BENCH_AB=TW_RS_REDUCE_LOADS=8,12 \
        "$bin/tw-bench" $op --world 2 $big_rs --repeats 10 --warmup 3
    done
    run "s37-trace-gemm_rs-flux-ld12" 90 env TW_TRACE=1 TW_RS_REDUCE_LOADS=12 "$bin/tw-bench" \
      gemm_rs --world 2 $flux_rs --repeats 10 --warmup 3
  fi
  rs_ab_8v s37 TW_RS_REDUCE_LOADS 8,12
}
exp_s36() { # (twenty-fourth session; the code stays on exp/next29) the reduce warps (TW_RS_REDUCE_WARPS=1: warps 2-3 of
  # every GEMM CTA's producer warpgroup reduce ready units during the tiles; tw_gemm_rs, fp32
  # partials): tests on both placements, then A/B against the default (both orders at flux-tp8,
  # where s35 put 74 us of reduction after the tiles), with no reduce CTA, at M=8192 / 16384 with
  # the reduce CTAs (TW_RS_OWNER_EPI=0), a trace at flux-tp8, and 8 virtual ranks
  local ab
  run "s36-test_gemm_rs" 200 "$bin/test_gemm_rs"
  if [ "$ngpus" -gt 1 ]; then
    run "s36-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
    for ab in 0,1 1,0; do
      run "s36-gemm_rs-flux-rw$ab" 90 env TW_BENCH_AB=TW_RS_REDUCE_WARPS=$ab \
        "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 20 --warmup 5
    done
    run "s36-gemm_rs-flux-red0-rw0,1" 90 env TW_RS_REDUCE_CTAS=0 TW_BENCH_AB=TW_RS_REDUCE_WARPS=0,1 \
      "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 20 --warmup 5
    run "s36-gemm_rs-m8192-epi0-rw0,1" 90 env TW_RS_OWNER_EPI=0 TW_BENCH_AB=TW_RS_REDUCE_WARPS=0,1 \
      "$bin/tw-bench" gemm_rs --world 2 --m 8192 --n 8192 --k 1024 --repeats 20 --warmup 5
    run "s36-gemm_rs-m16384-epi0-rw0,1" 120 env TW_RS_OWNER_EPI=0 \
      TW_BENCH_AB=TW_RS_REDUCE_WARPS=0,1 "$bin/tw-bench" gemm_rs --world 2 $big_rs --repeats 20 \
      --warmup 5
    run "s36-trace-gemm_rs-flux-rw1" 90 env TW_TRACE=1 TW_RS_REDUCE_WARPS=1 "$bin/tw-bench" \
      gemm_rs --world 2 $flux_rs --repeats 10 --warmup 3
  fi
  run "s36-gemm_rs-8v-m4096-rw0,1" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_REDUCE_WARPS=0,1 \
    "$bin/tw-bench" gemm_rs --world 8 --m 4096 --n 4096 --k 512 --repeats 20 --warmup 5
  run "s36-gemm_rs-8v-m16384-rw0,1" 150 env TW_BENCH_VIRTUAL=1 \
    TW_BENCH_AB=TW_RS_REDUCE_WARPS=0,1 "$bin/tw-bench" gemm_rs --world 8 $big_rs --repeats 10 \
    --warmup 3
}
exp_s35() { # (twenty-fourth session, measurements) flux-tp8 GEMM+RS's tail after the GEMM
  # (75-85 us in s32's trace): the reduce CTAs 4 (the plan) against 8 and 0 (every CTA reduces
  # after its tiles), both orders, and TW_TRACE=1 runs at 0 and 8 and with bf16 partials
  local ab n
  [ "$ngpus" -gt 1 ] || return 0
  for ab in 4,8 8,4 4,0 0,4; do
    run "s35-gemm_rs-flux-red$ab" 90 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab \
      "$bin/tw-bench" gemm_rs --world 2 $flux_rs --repeats 20 --warmup 5
  done
  for n in 0 8; do
    run "s35-trace-gemm_rs-flux-red$n" 90 env TW_TRACE=1 TW_RS_REDUCE_CTAS=$n "$bin/tw-bench" \
      gemm_rs --world 2 $flux_rs --repeats 10 --warmup 3
  done
}
exp_s34() { # (twenty-fourth session; the knob since removed) the owner epilogue's lag (TW_RS_OWNER_LAG, percent of
  # a wave; 200 the default): s33's trace put the lag order's cost at 50-60 us of GEMM phase at
  # flux-tp8 (two opening waves whose partials all go to the peer); tests, then A/B of 200
  # against 50 (and 100) where the owner epilogue runs, both orders, and the owner epilogue with
  # lag 50 against the reduce CTAs at flux-tp8
  local op ab
  run "s34-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s34-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for op in gemm_rs gemm_ar; do
    for ab in 200,50 50,200 200,100; do
      run "s34-$op-flux-epi1-lag$ab" 90 env TW_RS_OWNER_EPI=1 TW_BENCH_AB=TW_RS_OWNER_LAG=$ab \
        "$bin/tw-bench" $op --world 2 $flux_rs --repeats 20 --warmup 5
    done
    for ab in 200,50 50,200; do
      run "s34-$op-m8192-lag$ab" 90 env TW_BENCH_AB=TW_RS_OWNER_LAG=$ab \
        "$bin/tw-bench" $op --world 2 --m 8192 --n 8192 --k 1024 --repeats 20 --warmup 5
    done
    run "s34-$op-m16384-lag200,50" 120 env TW_BENCH_AB=TW_RS_OWNER_LAG=200,50 \
      "$bin/tw-bench" $op --world 2 $big_rs --repeats 20 --warmup 5
    run "s34-$op-flux-lag50-epi0,1" 90 env TW_RS_OWNER_LAG=50 TW_BENCH_AB=TW_RS_OWNER_EPI=0,1 \
      "$bin/tw-bench" $op --world 2 $flux_rs --repeats 20 --warmup 5
  done
}
exp_s33() { # (twenty-fourth session; the knob since removed) the owner epilogue's tile order with the reduce CTAs
  # (TW_RS_LAG_ORDER=1, measurement): tests on both placements, then A/B against the default
  # bands at flux-tp8, M=8192 K 1024 and M=16384 (fp32 and bf16 partials), both orders, and a
  # TW_TRACE run at flux-tp8 with it (the tail after the GEMM end against s32's 75-85 us)
  local op ab
  run "s33-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s33-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for op in gemm_rs gemm_ar; do
    for ab in 0,1 1,0; do
      run "s33-$op-flux-lag$ab" 90 env TW_BENCH_AB=TW_RS_LAG_ORDER=$ab \
        "$bin/tw-bench" $op --world 2 $flux_rs --repeats 20 --warmup 5
      run "s33-$op-m8192-lag$ab" 90 env TW_BENCH_AB=TW_RS_LAG_ORDER=$ab TW_RS_OWNER_EPI=0 \
        "$bin/tw-bench" $op --world 2 --m 8192 --n 8192 --k 1024 --repeats 20 --warmup 5
    done
  done
  run "s33-gemm_rs-m16384-lag0,1" 120 env TW_BENCH_AB=TW_RS_LAG_ORDER=0,1 TW_RS_OWNER_EPI=0 \
    "$bin/tw-bench" gemm_rs --world 2 $big_rs --repeats 20 --warmup 5
  run "s33-trace-gemm_rs-flux-lag1" 90 env TW_TRACE=1 TW_RS_LAG_ORDER=1 "$bin/tw-bench" gemm_rs \
    --world 2 $flux_rs --repeats 10 --warmup 3
}
exp_s32() { # (twenty-fourth session; the prefetch since removed) the owner epilogue with the peer's partials
  # prefetched into L2 late in each own tile's loads (TW_RS_OWNER_PREFETCH, default 1 there):
  # tests, then A/B against no prefetch where the owner epilogue runs (the default at M=8192 and
  # 16384 K < 4096; forced at flux-tp8, where it lost 1-3% without the prefetch), and the owner
  # epilogue with the prefetch against the reduce CTAs (the default) at flux-tp8; both orders
  local op ab
  run "s32-test_gemm_rs" 200 "$bin/test_gemm_rs"
  run "s32-test_plans" 30 "$bin/test_plans"
  [ "$ngpus" -gt 1 ] || return 0
  run "s32-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  for op in gemm_rs gemm_ar; do
    for ab in 0,1 1,0; do
      run "s32-$op-flux-epi1-pf$ab" 90 env TW_RS_OWNER_EPI=1 TW_BENCH_AB=TW_RS_OWNER_PREFETCH=$ab \
        "$bin/tw-bench" $op --world 2 $flux_rs --repeats 20 --warmup 5
      run "s32-$op-flux-epi$ab" 90 env TW_BENCH_AB=TW_RS_OWNER_EPI=$ab \
        "$bin/tw-bench" $op --world 2 $flux_rs --repeats 20 --warmup 5
      run "s32-$op-m8192-pf$ab" 90 env TW_BENCH_AB=TW_RS_OWNER_PREFETCH=$ab \
        "$bin/tw-bench" $op --world 2 --m 8192 --n 8192 --k 1024 --repeats 20 --warmup 5
      run "s32-$op-m16384-pf$ab" 120 env TW_BENCH_AB=TW_RS_OWNER_PREFETCH=$ab \
        "$bin/tw-bench" $op --world 2 $big_rs --repeats 20 --warmup 5
    done
  done
  # the kernels' own time at flux-tp8 (torch.profiler, one process per GPU): the default, and
  # the owner epilogue without and with the prefetch
  local label epi pf
  for label in default:-1:1 epi-pf0:1:0 epi-pf1:1:1; do
    IFS=: read -r label epi pf <<<"$label"
    run "s32-dist-profile-gemm_rs-flux-$label" 150 env TW_RS_OWNER_EPI=$epi \
      TW_RS_OWNER_PREFETCH=$pf TILEWIRE_LIB="$root/$bin/libtilewire.so" PYTHONPATH="$root/python" \
      python3 -m tilewire.bench_dist --nproc 2 --op gemm_rs $flux_rs --repeats 20 --profile
  done
  # 8 virtual ranks at decode: tw_gemm_ar's new shared-GPU rule (the unfused pipeline at
  # m <= 64) against the fused kernel, M=16 / 64 / 256, both orders
  local m
  for m in 16 64 256; do
    for ab in 0,-1 -1,0; do
      run "s32-gemm_ar-8v-m$m-unf$ab" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_UNFUSED_SMALL=$ab \
        "$bin/tw-bench" gemm_ar --m $m --n 8192 --k 1024 --repeats 30 --warmup 5
    done
  done
  # where the fused GEMM+RS's time goes at flux-tp8 (TW_TRACE: GEMM end against kernel end)
  run "s32-trace-gemm_rs-flux" 90 env TW_TRACE=1 "$bin/tw-bench" gemm_rs --world 2 $flux_rs \
    --repeats 10 --warmup 3
}
exp_s31() { # (twenty-third session) 8 virtual ranks: the unfused pipeline inside the call
  # (TW_RS_UNFUSED_SMALL=1) against the default (the fused kernel where ranks share a GPU), every
  # default shape, both orders; the 8-rank GEMM+AR at M=4096 K 512 lost to tw_gemm + reduce
  local op
  for op in gemm_ar gemm_rs; do
    run "s31-$op-8v-ab" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_UNFUSED_SMALL=-1,1 \
      "$bin/tw-bench" $op --repeats 15 --warmup 3
    run "s31-$op-8v-ba" 200 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_UNFUSED_SMALL=1,-1 \
      "$bin/tw-bench" $op --repeats 15 --warmup 3
  done
}
exp_s30() { # (twenty-third session) the PyTorch view: eager decode one process per GPU with
  # the fast lane off and on (many repeats: the eager rows are host-bound and jittery), and the
  # kernels' own time at flux-tp8 under torch.profiler (where ~0.1 ms per call was unexplained)
  [ "$ngpus" -gt 1 ] || return 0
  local op lane
  for op in gemm_rs gemm_ar ag_gemm; do
    for lane in 0 1; do
      run "s30-dist-eager-$op-lane$lane" 90 env TILEWIRE_FAST_LANE=$lane \
        TILEWIRE_LIB="$root/$bin/libtilewire.so" PYTHONPATH="$root/python" python3 -m \
        tilewire.bench_dist --nproc 2 --op $op --m 64 --n $([ $op = ag_gemm ] && echo 1024 ||
          echo 8192) --k $([ $op = ag_gemm ] && echo 8192 || echo 1024) --repeats 300
    done
  done
  for op in gemm_rs gemm_ar; do
    run "s30-dist-profile-$op-flux" 150 env TILEWIRE_LIB="$root/$bin/libtilewire.so" \
      PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op $op $flux_rs \
      --repeats 20 --profile
  done
}
exp_s29() { # (branch exp/next25, run and merged in the twenty-third session) split-K through a workspace: the tree's slices as
  # single CTAs on 64-row swap tiles, twice the CTAs, the same bits
  local m
  run "s29-test_plans" 30 "$bin/test_plans"
  run "s29-test_gemm" 200 "$bin/test_gemm"
  run "s29-test_ag_gemm" 200 "$bin/test_ag_gemm"
  run "s29-memcheck-test_gemm" 300 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm"
  for m in 16 32 64 128; do
    run "s29-gemm-split-graph-m$m" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_SPLITK=1 \
      "$bin/tw-bench" gemm --m $m --n 1024 --k 8192 --repeats 50 --warmup 5
  done
  [ "$ngpus" -gt 1 ] || return 0
  run "s29-test_ag_gemm-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_ag_gemm"
  # the decode path with TW_TRACE (a host callback between the allgather and the GEMM that is
  # launched as its programmatic dependent: not run before) and with the watchdog's rows
  run "s29-trace-ag-decode" 90 env TW_TRACE=1 "$bin/tw-bench" ag_gemm --world 2 --m 16 \
    --n 1024 --k 8192 --repeats 10 --warmup 2
  run "s29-watchdog-ag-decode" 90 env TW_WATCHDOG_S=5 "$bin/tw-bench" ag_gemm --world 2 \
    --m 16 --n 1024 --k 8192 --repeats 10 --warmup 2
  ag_knob_ab s29 TW_AG_GEMM_WS ws
  run "s29-pytest-gemm" 150 env TILEWIRE_LIB="$root/$bin/libtilewire.so" python3 -m pytest \
    python/tests -q -k "gemm or dist"
}
exp_s28() { # (twenty-second session) measurements for the decode GEMM's next step
  local m v
  [ -x "$bin/probe_clusters" ] && run "s28-probe-clusters" 30 "$bin/probe_clusters"
  for m in 16 32 64 128; do
    run "s28-gemm-split-graph-m$m" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_SPLITK=1 \
      "$bin/tw-bench" gemm --m $m --n 1024 --k 8192 --repeats 50 --warmup 5
  done
  run "s28-ncu-m32" 240 env TW_BENCH_WARM_MS=0 TW_BENCH_GEMM_SPLITK=1 ncu --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section LaunchStats --section Occupancy --section SchedulerStats -c 40 "$bin/tw-bench" \
    gemm --m 32 --n 1024 --k 8192 --repeats 1 --warmup 1 --no-check
  [ "$ngpus" -gt 1 ] || return 0
  for m in 128 256; do # shards of 1 / 2 MiB: over the area's 512 KiB rule
    for v in -1 1; do
      run "s28-dist-graph-agll$v-m$m" 60 env TW_AG_LL=$v TILEWIRE_LIB="$root/$bin/libtilewire.so" \
        PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op ag_gemm \
        --m $m --n 1024 --k 8192 --repeats 50 --graph 20
    done
  done
}
exp_s27() { # (run in the twenty-second session, merged) tw_ag_gemm's decode GEMM launched as a programmatic
  # dependent of its allgather (TW_AG_PDL): tests, then A/B from graphs (alternating) and eager
  local m v round
  run "s27-test_gemm" 200 "$bin/test_gemm"
  run "s27-test_ag_gemm" 200 "$bin/test_ag_gemm"
  run "s27-test_gemm_rs" 200 "$bin/test_gemm_rs" # the core's loop changed for every GEMM
  for m in 32 128; do # the decode products of M=16 / 64 per rank on 2: tw_gemm vs cuBLAS
    run "s27-gemm-graph-m$m" 60 env TW_BENCH_GRAPH=1 "$bin/tw-bench" gemm --m $m --n 1024 \
      --k 8192 --repeats 50 --warmup 5
  done
  [ "$ngpus" -gt 1 ] || return 0
  run "s27-test_ag_gemm-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_ag_gemm"
  run "s27-test_allgather-distinct" 150 env TW_TEST_DEVICES=distinct "$bin/test_allgather"
  run "s27-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  run "s27-memcheck-test_ag_gemm-distinct" 150 env TW_TEST_DEVICES=distinct compute-sanitizer \
    --error-exitcode=1 --tool memcheck "$bin/test_ag_gemm" --small
  ag_knob_ab s27 TW_AG_PDL pdl
  run "s27-pytest-ag" 120 env TILEWIRE_LIB="$root/$bin/libtilewire.so" python3 -m pytest \
    python/tests -q -k "ag_gemm or dist"
}
exp_s26() { # (run in the twenty-second session, merged) the GEMM's epilogue storing the low-latency words
  # itself (TW_RS_LL_EPI) and tw_ll_wait's trace row: tests on both placements, the watchdog's
  # view, A/B from graphs (alternating) and eager
  local m v op round
  run "s26-test_gemm" 150 "$bin/test_gemm"
  run "s26-test_allgather" 150 "$bin/test_allgather"
  [ "$ngpus" -gt 1 ] &&
    run "s26-test_allgather-distinct" 150 env TW_TEST_DEVICES=distinct "$bin/test_allgather"
  run "s26-test_ag_gemm" 150 "$bin/test_ag_gemm"
  unfused_tests s26 || return 0
  # tw_allgather through the area (TW_AG_LL) at decode shards: ag_gemm from graphs, alternating
  ag_decode_ab s26-dist-graph-agll TW_AG_LL "0 -1"
  for v in 0 1; do # tw_allgather alone (=1: through the area wherever it fits, here <= 2 MiB)
    run "s26-allgather-ll$v" 90 env TW_AG_LL=$v "$bin/tw-bench" allgather --world 2
  done
  for round in a b; do
    for v in 0 1; do
      for m in 16 64; do
        TW_RS_LL_EPI=$v dist_graph "s26-dist-graph-epi$v$round" "m$m" 60 \
          "--repeats 50 --graph 20" "--m $m --n 8192 --k 1024" ""
      done
    done
  done
  # M=64 fp32 partials (2 MiB of words a peer): the rule pulls; with the epilogue's words the
  # area may win there too
  for v in 0 1; do
    TW_RS_UNFUSED_LL=1 TW_RS_LL_EPI=$v dist_graph "s26-dist-graph-ll1-epi$v" m64 60 \
      "--repeats 50 --graph 20" "--m 64 --n 8192 --k 1024" ""
  done
  for op in gemm_rs gemm_ar; do
    run "s26-$op-ab-m16" 90 env TW_BENCH_AB=TW_RS_LL_EPI=0,1 "$bin/tw-bench" $op \
      --world 2 --m 16 --n 8192 --k 1024 --repeats 30 --warmup 5
  done
}
exp_s25() { # twenty-first session, exp/next22 (exp/ll + exp/swap64) in one call of ~500 s on 2
  # GPUs: both branches' tests (the one-GPU halves of s23 already ran), the 64-row swap tiles'
  # gemm rows, then from graphs swap 128 / 64 rows and the low-latency exchange against the pull
  local shape m v op
  run "s25-test_gemm" 150 "$bin/test_gemm"
  run "s25-test_ag_gemm" 150 "$bin/test_ag_gemm"
  run "s25-test_plans" 30 "$bin/test_plans"
  run "s25-test_gemm_rs" 200 "$bin/test_gemm_rs"
  for shape in "--m 16 --n 8192 --k 1024" "--m 64 --n 8192 --k 1024" \
    "--m 64 --n 8192 --k 3584" "--m 16 --n 4096 --k 4096"; do
    run "s25-gemm-graph-${shape// /}" 60 env TW_BENCH_GRAPH=1 "$bin/tw-bench" gemm $shape \
      --repeats 50 --warmup 5
  done
  [ "$ngpus" -gt 1 ] || return 0
  run "s25-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  run "s25-test_stall-distinct" 150 env TW_TEST_DEVICES=distinct "$bin/test_stall"
  run "s25-test_mp" 120 "$bin/test_mp" "$ngpus" 50
  for m in 16 64; do
    for v in "TW_GEMM_SWAP=1 TW_RS_UNFUSED_LL=0" "TW_RS_UNFUSED_LL=0" "TW_RS_UNFUSED_LL=-1" \
      "TW_GEMM_SWAP=1 TW_RS_UNFUSED_LL=-1"; do
      # the assignments before the function call are its processes' environment
      eval "$v dist_graph \"s25-dist-graph-${v// /-}\" m$m 60 \"--repeats 50 --graph 20\" \
        \"--m $m --n 8192 --k 1024\" \"\""
    done
  done
  for op in gemm_rs gemm_ar; do
    run "s25-$op-ab-m16" 90 env TW_BENCH_AB=TW_RS_UNFUSED_LL=0,-1 "$bin/tw-bench" $op \
      --world 2 --m 16 --n 8192 --k 1024 --repeats 30 --warmup 5
  done
  run "s25-pytest-rs" 150 env TILEWIRE_LIB="$root/$bin/libtilewire.so" python3 -m pytest \
    python/tests -q -k "gemm_rs or gemm_ar or dist"
}
exp_s23() { # twenty-first session (exp/ll, not run): the unfused decode pipeline's rows through
  # the comm's low-latency area (TW_RS_UNFUSED_LL, flags in the data words): its tests on both
  # placements, then A/B against the pull from graphs (alternating) and eager
  unfused_tests s23 || return 0
  local v m op round
  for round in a b; do
    for v in 0 -1; do
      for m in 16 64; do
        TW_RS_UNFUSED_LL=$v dist_graph "s23-dist-graph-ll$v$round" "m$m" 60 \
          "--repeats 50 --graph 20" "--m $m --n 8192 --k 1024" ""
      done
    done
  done
  TW_RS_UNFUSED_LL=0 dist_graph "s23-dist-graph-ll0" m128 60 "--repeats 50 --graph 20" \
    "--m 128 --n 8192 --k 1024" ""
  TW_RS_UNFUSED_LL=-1 dist_graph "s23-dist-graph-ll-1" m128 60 "--repeats 50 --graph 20" \
    "--m 128 --n 8192 --k 1024" ""
  for m in 16 64; do
    for op in gemm_rs gemm_ar; do
      run "s23-$op-ab-m$m" 90 env TW_BENCH_AB=TW_RS_UNFUSED_LL=0,-1 "$bin/tw-bench" $op \
        --world 2 --m $m --n 8192 --k 1024 --repeats 30 --warmup 5
    done
  done
}
unfused_tests() { # $1: the group: the unfused decode pipeline's tests (test_plans, test_gemm_rs,
  # test_stall, memcheck of test_gemm_rs --small), then on 2 GPUs the distinct placements,
  # test_mp one process per GPU and pytest's ops; fails where there is one GPU
  run "$1-test_plans" 30 "$bin/test_plans"
  run "$1-test_gemm_rs" 200 "$bin/test_gemm_rs"
  run "$1-test_stall" 150 "$bin/test_stall"
  run "$1-memcheck-test_gemm_rs" 300 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm_rs" --small
  [ "$ngpus" -gt 1 ] || return 1
  run "$1-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  run "$1-test_stall-distinct" 150 env TW_TEST_DEVICES=distinct "$bin/test_stall"
  run "$1-test_mp" 120 "$bin/test_mp" "$ngpus" 50
  run "$1-pytest-rs" 150 env TILEWIRE_LIB="$root/$bin/libtilewire.so" python3 -m pytest \
    python/tests -q -k "gemm_rs or gemm_ar or dist"
}
exp_s21() { # twentieth session: main with ReleasedWait (s20 measured it, the push and the
  # 128 x 64 tiles were dropped): its tests on both placements, memcheck of the unfused path,
  # and the release-wait A/B from graphs once more
  unfused_tests s21 || return 0
  local v
  for v in 0 1; do
    TW_RS_UNFUSED_WAIT_KERNEL=$v dist_graph "s21-dist-graph-wk$v" m16 90 \
      "--repeats 50 --graph 20" "--m 16 --n 8192 --k 1024" ""
  done
}
ag_knob_ab() { # GROUP KNOB TAG: a 0/1 knob of tw_ag_gemm's decode path, from graphs in two
  # alternating rounds (GROUP-dist-graph-TAG<v><round>-m<M>) and eager (GROUP-ag_gemm-ab-m<M>)
  local m
  ag_decode_ab "$1-dist-graph-$3" "$2" "0 1"
  for m in 16 64; do
    run "$1-ag_gemm-ab-m$m" 90 env TW_BENCH_AB="$2=0,1" "$bin/tw-bench" ag_gemm --world 2 \
      --m $m --n 1024 --k 8192 --repeats 30 --warmup 5
  done
}
ag_decode_ab() { # PREFIX KNOB "VALUES": tw_ag_gemm at decode shards (M 16 / 64, n 1024/rank, K
  # 8192) from CUDA graphs, one process per GPU, under each value in two alternating rounds;
  # logs PREFIX<value><round>-m<M>
  local round v m
  for round in a b; do
    for v in $3; do
      for m in 16 64; do
        run "$1$v$round-m$m" 60 env "$2=$v" TILEWIRE_LIB="$root/$bin/libtilewire.so" \
          PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op ag_gemm \
          --m $m --n 1024 --k 8192 --repeats 50 --graph 20
      done
    done
  done
}
dist_graph() { # NAME TAG LIMIT "BENCH ARGS" "RS/AR SHAPE" ["AG SHAPE"]: tilewire.bench_dist one
  # process per GPU (graph replays in the bench args): gemm_rs and gemm_ar at the first shape,
  # ag_gemm at the second where given; logs NAME-OP-TAG
  local name=$1 tag=$2 limit=$3 args=$4 rs=$5 ag=${6:-} op
  local py="env TILEWIRE_LIB=$root/$bin/libtilewire.so PYTHONPATH=$root/python"
  for op in gemm_rs gemm_ar; do
    run "$name-$op-$tag" "$limit" $py python3 -m tilewire.bench_dist --nproc 2 --op $op $rs $args
  done
  [ -z "$ag" ] ||
    run "$name-ag_gemm-$tag" "$limit" $py python3 -m tilewire.bench_dist --nproc 2 --op ag_gemm \
      $ag $args
}
unfused_ab() { # $1: the group: TW_RS_UNFUSED_SMALL=0,1 in A/B at decode shapes on 2 GPUs
  local m op
  for m in 16 64 256 512; do
    for op in gemm_rs gemm_ar; do
      run "$1-$op-ab-m$m" 90 env TW_BENCH_AB=TW_RS_UNFUSED_SMALL=0,1 "$bin/tw-bench" $op \
        --world 2 --m $m --n 8192 --k 1024 --repeats 30 --warmup 5
    done
  done
}
unfused_graph() { # $1: the group: GEMM+RS / GEMM+AR at decode shapes from CUDA graphs
  local py="env TILEWIRE_LIB=$root/$bin/libtilewire.so PYTHONPATH=$root/python" m op
  for m in 16 64 256; do
    for op in gemm_rs gemm_ar; do
      run "$1-$op-graph-m$m" 90 env TW_BENCH_GRAPH=1 "$bin/tw-bench" $op --world 2 --m $m \
        --n 8192 --k 1024 --repeats 50 --warmup 5
    done
  done
  for op in gemm_rs gemm_ar; do
    run "$1-dist-graph-$op-m64" 90 $py python3 -m tilewire.bench_dist --nproc 2 --op $op \
      --m 64 --n 8192 --k 1024 --repeats 50 --graph 20
  done
}
exp_s19c() { # nineteenth session: the unfused pipeline inside tw_gemm_rs / tw_gemm_ar
  # (TW_RS_UNFUSED_SMALL: tw_gemm into the workspace, then one reduce kernel; the default at
  # m <= 256 on distinct GPUs): its tests, then A/B against the fused kernel at decode shapes,
  # eager and from graphs, one process and one per GPU
  unfused_tests s19c || return 0
  unfused_ab s19c
  unfused_graph s19c
}
exp_s19d() { # nineteenth session, after s19c: the unfused reduce kernel's fp32 loads made
  # contiguous (one 16-byte load per rank and thread): its tests on both placements and the
  # decode A/B again
  run "s19d-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s19d-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  unfused_ab s19d
  unfused_graph s19d
}
exp_s19e() { # nineteenth session, last call: the rule from s19c/s19d (tw_gemm_rs unfused at
  # m <= 512, tw_gemm_ar then at 64 <= m <= 256, distinct GPUs; the lower bound was dropped
  # after its M=16 graph A/B): the tests on both placements, one process per GPU, the decode
  # A/B once more and the graph rows one process per GPU
  local py="env TILEWIRE_LIB=$root/$bin/libtilewire.so PYTHONPATH=$root/python" m op
  run "s19e-test_plans" 30 "$bin/test_plans"
  run "s19e-test_gemm_rs" 200 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  run "s19e-test_gemm_rs-distinct" 200 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  run "s19e-test_stall-distinct" 150 env TW_TEST_DEVICES=distinct "$bin/test_stall"
  run "s19e-test_mp" 120 "$bin/test_mp" "$ngpus" 50
  unfused_ab s19e
  for m in 16 256; do
    for op in gemm_rs gemm_ar; do
      run "s19e-dist-graph-$op-m$m" 90 $py python3 -m tilewire.bench_dist --nproc 2 --op $op \
        --m $m --n 8192 --k 1024 --repeats 50 --graph 20
    done
  done
}
exp_s19() { # prepared in the eighteenth session, run in the nineteenth (docs/PERF.md): GPU time at
  # decode shapes, where eager tw-bench rows time the host (cuBLAS 13 us eager, 8.6 us in
  # bench_dist's graphs): tw-bench gemm under TW_BENCH_GRAPH=1 (16 calls per graph), split rows
  # against cuBLAS; the fused ops replayed from graphs on 2 GPUs; traces of GEMM+RS / GEMM+AR at
  # M=64 on 128-wide tiles (where the ~20 us beyond the GEMM go)
  local shape op m
  for shape in "--m 64 --n 1024 --k 8192" "--m 16 --n 1024 --k 8192" "--m 256 --n 1024 --k 8192" \
    "--m 64 --n 8192 --k 1024" "--m 64 --n 8192 --k 3584"; do
    run "s19-gemm-graph-${shape// /}" 60 env TW_BENCH_GRAPH=1 TW_BENCH_GEMM_SPLITK=1 \
      "$bin/tw-bench" gemm $shape --repeats 50 --warmup 5
    run "s19-gemm-eager-${shape// /}" 60 env TW_BENCH_GEMM_SPLITK=1 "$bin/tw-bench" gemm $shape \
      --repeats 50 --warmup 5
  done
  [ "$ngpus" -gt 1 ] || return 0
  for m in 16 64 256; do
    for op in gemm_rs gemm_ar; do
      run "s19-$op-graph-m$m" 90 env TW_BENCH_GRAPH=1 "$bin/tw-bench" $op --world 2 --m $m \
        --n 8192 --k 1024 --repeats 50 --warmup 5
    done
    run "s19-ag-graph-m$m" 90 env TW_BENCH_GRAPH=1 "$bin/tw-bench" ag_gemm --world 2 --m $m \
      --n 1024 --k 8192 --repeats 50 --warmup 5
  done
  for op in gemm_rs gemm_ar; do
    run "s19-trace-$op-m64" 60 env TW_TRACE=1 "$bin/tw-bench" $op --world 2 --m 64 --n 8192 \
      --k 1024 --repeats 10 --warmup 3 --no-check
  done
  # flux-tp8, one process per GPU, replayed from graphs of 10 calls: the GPU time per call with
  # no host or cross-GPU fork/join in it (eager tw-bench leaves ~0.1 ms of the fused GEMM+RS's
  # 1.13 ms outside the traced kernel spans; of-bound 0.72-0.80 there)
  dist_graph s19-dist-graph flux 150 "--repeats 30 --graph 10" "--m 4096 --n 12288 --k 6144" \
    "--m 4096 --n 6144 --k 12288"
  # the same from one process (tw-bench): every row, NCCL's too, replayed from graphs, and eager
  # with 8 calls per fork / join (the cross-GPU fork / join starts the ranks ~70 us apart)
  for op in gemm_rs gemm_ar; do
    run "s19-graph-$op-flux" 120 env TW_BENCH_GRAPH=1 "$bin/tw-bench" $op --world 2 $flux_rs \
      --repeats 20 --warmup 5
    run "s19-block8-$op-flux" 120 env TW_BENCH_BLOCK=8 "$bin/tw-bench" $op --world 2 $flux_rs \
      --repeats 20 --warmup 5
  done
}
exp_s19b() { # prepared in the eighteenth session, run in the nineteenth (docs/PERF.md): split-K
  # with TW_SPLIT_SCATTER=1 (every slice sums and stores one column band: one round through
  # distributed shared memory on every path, against the tree's log2(split)): test_gemm (its
  # scatter cases), memcheck of it, tw-bench gemm's split rows (scatter rows beside the tree's)
  run "s19b-test_gemm" 120 "$bin/test_gemm"
  local shape
  for shape in "--m 64 --n 1024 --k 8192" "--m 16 --n 1024 --k 8192" "--m 256 --n 1024 --k 8192"; do
    run "s19b-gemm-${shape// /}" 60 env TW_BENCH_GEMM_SPLITK=1 "$bin/tw-bench" gemm $shape \
      --repeats 50 --warmup 5
  done
}
exp_s19m() { # memcheck of test_gemm with the scatter cases (split from s19b to fit one call)
  run "s19b-memcheck-test_gemm" 400 compute-sanitizer --error-exitcode=1 --tool memcheck \
    "$bin/test_gemm"
}
exp_s18c() { # eighteenth session, last call: main's head after the merge (the tree sum and the
  # split rule of 16 K blocks per slice, 8 slices up to 8 tiles): the split's tests and figures
  local py="env TILEWIRE_LIB=$root/$bin/libtilewire.so PYTHONPATH=$root/python" shape
  run "s18c-test_gemm" 120 "$bin/test_gemm"
  run "s18c-test_ag_gemm" 150 "$bin/test_ag_gemm"
  for shape in "--m 64 --n 1024 --k 8192" "--m 256 --n 1024 --k 8192"; do
    run "s18c-gemm-${shape// /}" 60 env TW_BENCH_GEMM_SPLITK=1 "$bin/tw-bench" gemm $shape \
      --repeats 50 --warmup 5
  done
  [ "$ngpus" -gt 1 ] || return 0
  run "s18c-test_ag_gemm-distinct" 150 env TW_TEST_DEVICES=distinct "$bin/test_ag_gemm"
  run "s18c-test_mp" 120 "$bin/test_mp" "$ngpus" 20
  run "s18c-pytest-decode" 150 env TILEWIRE_LIB="$root/$bin/libtilewire.so" python3 -m pytest \
    python/tests -q -k "decode or split"
  for shape in "--m 64" "--m 16" "--m 256"; do
    run "s18c-ag-${shape// /}" 60 "$bin/tw-bench" ag_gemm --world 2 $shape --n 1024 --k 8192 \
      --repeats 50 --warmup 5
  done
  run "s18c-graph-ag_gemm-m64" 90 $py python3 -m tilewire.bench_dist --nproc 2 --op ag_gemm \
    --m 64 --n 1024 --k 8192 --repeats 50 --graph 20
}
exp_s18b() { # eighteenth session, second call (after the suite on exp/next18 with the rules
  # from s18): branch exp/splitk-tree's library in $TW_BUILD_DIR/tree (the slices' sum as a
  # binary tree, warpgroups without rows skip it): test_gemm, tw-bench gemm's split rows, and
  # ag_gemm at decode against this build's; the rules' checks
  local tree="$bin/tree" shape
  if [ -x "$tree/test_gemm" ]; then
    run "s18b-tree-test_gemm" 120 env LD_LIBRARY_PATH="$root/$tree:$LD_LIBRARY_PATH" "$tree/test_gemm"
    for shape in "--m 64 --n 1024 --k 8192" "--m 16 --n 1024 --k 8192" \
      "--m 256 --n 1024 --k 8192" "--m 64 --n 8192 --k 1024"; do
      run "s18b-tree-gemm-${shape// /}" 60 env LD_LIBRARY_PATH="$root/$tree:$LD_LIBRARY_PATH" \
        TW_BENCH_GEMM_SPLITK=1 "$tree/tw-bench" gemm $shape --repeats 50 --warmup 5
      run "s18b-base-gemm-${shape// /}" 60 env TW_BENCH_GEMM_SPLITK=1 "$bin/tw-bench" gemm \
        $shape --repeats 50 --warmup 5
    done
  fi
  # the tile width where ranks share a GPU (the rule now keeps 256 there), the other order
  run "s18b-8v-gemm_ar-decode" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_BLOCK_N=128,256 \
    "$bin/tw-bench" gemm_ar --m 64 --n 8192 --k 1024 --repeats 30 --warmup 5
  [ "$ngpus" -gt 1 ] || return 0
  if [ -x "$tree/tw-bench" ]; then
    run "s18b-tree-ag-m64" 60 env LD_LIBRARY_PATH="$root/$tree:$LD_LIBRARY_PATH" "$tree/tw-bench" ag_gemm \
      --world 2 --m 64 --n 1024 --k 8192 --repeats 50 --warmup 5
    run "s18b-base-ag-m64" 60 "$bin/tw-bench" ag_gemm --world 2 --m 64 --n 1024 --k 8192 \
      --repeats 50 --warmup 5
  fi
  # GEMM+AR's direct scheme for fp32 partials at m < 128 (now the default there)
  for ab in 0,1 1,0; do
    run "s18b-gemm_ar-m16-direct-$ab" 60 env TW_BENCH_AB=TW_AR_DIRECT=$ab "$bin/tw-bench" \
      gemm_ar --world 2 --m 16 --n 8192 --k 1024 --repeats 50 --warmup 5
  done
  run "s18b-graph-gemm_ar-m64" 90 env TILEWIRE_LIB="$root/$bin/libtilewire.so" \
    PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --op gemm_ar --m 64 \
    --n 8192 --k 1024 --repeats 50 --graph 20
}
exp_memo17() { # branch exp/tma-memo (sixteenth session; run and merged in the seventeenth): the
  # per-thread memo of TMA tensor maps (TW_TMA_MEMO, default on): the GPU tests with it, then
  # the host cost per call with it off and on (bench_dist --host, 2 GPUs; its
  # cuTensorMapEncodeTiled row says what one encode costs)
  run "memo17-test_gemm" 60 "$bin/test_gemm"
  run "memo17-test_ag_gemm" 120 "$bin/test_ag_gemm"
  run "memo17-test_gemm_rs" 150 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  [ "$ngpus" -gt 1 ] || return 0
  local memo
  for memo in 0 1 0 1; do
    run "memo17-host-$memo" 120 env TW_TMA_MEMO=$memo TILEWIRE_LIB="$root/$bin/libtilewire.so" \
      PYTHONPATH="$root/python" python3 -m tilewire.bench_dist --nproc 2 --host
    summary+=("$(grep -E '^(tilewire\.|tw_|cuTensorMap)' "$out/logs/memo17-host-$memo.log" |
      awk -v m="$memo" '{printf "  memo=%s %s", m, $0 "\n"}')")
  done
}
exp_fp32out15() { # fifteenth session: what fp32 output costs the GEMM core against cuBLAS
  # (the fused GEMM+RS / GEMM+AR epilogue with fp32 partials stores 4 bytes per element):
  # tw-bench gemm's fp32-out rows at the 2-GPU shapes, 132 SMs and the 128 GEMM CTAs flux-tp8's
  # plan leaves
  local shape
  for shape in "--m 4096 --n 12288 --k 6144" "--m 16384 --n 16384 --k 2048" \
    "--m 8192 --n 8192 --k 1024" "--m 4096 --n 4096 --k 512"; do
    run "fp32out15-${shape// /}" 60 env TW_BENCH_GEMM_FP32=1 "$bin/tw-bench" gemm $shape \
      --repeats 30 --warmup 5
  done
  run "fp32out15-flux-128" 60 env TW_BENCH_GEMM_FP32=1 "$bin/tw-bench" gemm --m 4096 --n 12288 \
    --k 6144 --sm-budget 128 --repeats 30 --warmup 5
}
exp_final15() { # fifteenth session's last check: 8 virtual ranks at M=4096 K 512 in 6
  # interleaved rounds (the GEMM+AR target's closest shape, ordinary and symmetric out)
  local s4="--m 4096 --n 4096 --k 512" op
  for op in gemm_ar gemm_rs; do
    run "final15-vr-$op-4096" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_ROUNDS=6 "$bin/tw-bench" $op $s4 \
      --repeats 60 --warmup 5
  done
}
exp_l2h15() { # fifteenth session: L2 hints in the reduction and the gather (a -DTW_RS_DIAG=256
  # build in $TW_BUILD_DIR/diag256, results right): partials read evict-first, out written
  # streaming, so tw_gemm_ar's reduced rows stay in L2 for the gather. test_gemm_rs with it on
  # one GPU; then default / 256 alternated twice, 8 virtual ranks at short K and small m, and
  # 2 GPUs' GEMM+AR sweep; then long interleaved runs of the 8-rank large shapes (the overlap
  # figures of issues 4 and 5, rounds against the power cap's drift)
  local s4="--m 4096 --n 4096 --k 512" small="--m 1024 --n 8192 --k 2048" d lib rep op shape
  local d256="$root/$bin/diag256"
  [ -e "$d256/libtilewire.so.0" ] || return 0
  run "l2h15-test_gemm_rs-256" 150 env LD_LIBRARY_PATH="$d256:$LD_LIBRARY_PATH" \
    TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  for rep in 1 2; do
    for d in 0 256; do
      lib="$root/$bin"
      [ "$d" = 0 ] || lib="$d256"
      for op in gemm_ar gemm_rs; do
        for shape in "$s4" "$small"; do
          run "l2h15-vr-$op-${shape// /}-d$d-$rep" 60 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" \
            TW_BENCH_VIRTUAL=1 "$bin/tw-bench" $op $shape --repeats 20 --warmup 5
        done
      done
      [ "$ngpus" -gt 1 ] || continue
      run "l2h15-gpus-gemm_ar-d$d-$rep" 90 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" \
        "$bin/tw-bench" gemm_ar --world 2 --repeats 20 --warmup 5
    done
  done
  run "l2h15-vr-ag-16384" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_ROUNDS=4 "$bin/tw-bench" ag_gemm \
    --m 16384 --n 2048 --k 16384 --repeats 40 --warmup 5
  run "l2h15-vr-ar-16384" 120 env TW_BENCH_VIRTUAL=1 TW_BENCH_ROUNDS=4 "$bin/tw-bench" gemm_ar \
    $big_rs --repeats 24 --warmup 3
}
exp_wave15() { # branch exp/wave-reduce: the reduce-CTA rule at the wave boundary (-1) against the
  # old estimate's counts, both orders, 2 GPUs: flux-tp8 GEMM+RS 4 / 5, GEMM+AR 4 / 7; bf16
  # partials (the tilewire-bf16p rows) GEMM+RS M=8192 11 / 14, M=16384 5 / 7, GEMM+AR M=16384
  # 9 / 11; then test_gemm_rs
  local spec name old op shape ab
  [ "$ngpus" -gt 1 ] || return 0
  for spec in "flux-rs:5:gemm_rs:$flux_rs" "flux-ar:7:gemm_ar:$flux_rs" \
    "rs8192:14:gemm_rs:--m 8192 --n 8192 --k 1024" "rs16384:7:gemm_rs:$big_rs" \
    "ar16384:11:gemm_ar:$big_rs"; do
    IFS=: read -r name old op shape <<<"$spec"
    for ab in "-1,$old" "$old,-1"; do
      run "wave15-$name-$ab" 90 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab "$bin/tw-bench" $op $shape \
        --world 2 --repeats 20 --warmup 5
    done
  done
  run "wave15-test_gemm_rs-gpus" 150 env TW_WATCHDOG_S=15 TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
}
exp_next15() { # prepared in the fourteenth session, run in the fifteenth (docs/PERF.md). (1) 2 GPUs: the reduce-CTA count at
  # the wave boundary (flux-tp8: the plan's 5 / 7 reduce CTAs leave 127 / 125 GEMM CTAs for 1536
  # tiles, 12.1 / 12.3 waves; 4 leave 128, exactly 12; small-m GEMM+AR: 19 -> 2.3 waves, 4 ->
  # 2), both orders. (2) 8 virtual ranks: TW_TRACE of GEMM+AR / GEMM+RS at M=4096 K 512 (with
  # branch exp/trace-gather merged the GEMM+AR lines split the gather's own waits).
  local s4="--m 4096 --n 4096 --k 512" small="--m 1024 --n 8192 --k 2048" op ab
  if [ "$ngpus" -gt 1 ]; then
    for op in gemm_rs gemm_ar; do
      for ab in -1,4 4,-1; do
        run "next15-flux-$op-$ab" 60 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab "$bin/tw-bench" $op \
          $flux_rs --world 2 --repeats 30 --warmup 5
      done
    done
    for ab in -1,4 4,-1; do
      run "next15-small-gemm_ar-$ab" 60 env TW_BENCH_AB=TW_RS_REDUCE_CTAS=$ab "$bin/tw-bench" \
        gemm_ar $small --world 2 --repeats 30 --warmup 5
    done
  fi
  for op in gemm_ar gemm_rs; do
    run "next15-trace-$op" 60 env TW_TRACE=1 TW_BENCH_VIRTUAL=1 "$bin/tw-bench" $op $s4 \
      --repeats 3 --warmup 1 --no-check
  done
}
exp_knobs14() { # fourteenth session, 8 virtual ranks with the pull (the default there now): the
  # knobs tuned under the push, in A/B at short K (bands, the grouped order, reduce CTAs;
  # GEMM+AR's push gather and unit groups)
  local s4="--m 4096 --n 4096 --k 512" s8="--m 8192 --n 8192 --k 1024" op shape ab
  for shape in "$s4" "$s8"; do
    for op in gemm_rs gemm_ar; do
      for ab in TW_RS_BAND=1,2,4 TW_RS_GROUPED=0,1 TW_RS_REDUCE_CTAS=-1,2; do
        run "knobs14-$op-${shape// /}-${ab%%=*}" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=$ab \
          "$bin/tw-bench" $op $shape --repeats 15 --warmup 4
      done
    done
    for ab in TW_AR_PUSH=-1,1 TW_RS_GROUP_UNITS=0,2; do
      run "knobs14-gemm_ar-${shape// /}-${ab%%=*}" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=$ab \
        "$bin/tw-bench" gemm_ar $shape --repeats 15 --warmup 4
    done
  done
}
exp_pull14() { # fourteenth session, 8 virtual ranks: the pull (each rank's whole partial stored
  # locally in the plain GEMM's layout, the owners reading their rows) against the push at
  # short K, both orders; the measurement build bit 1 (every partial into the own slot)
  local s4="--m 4096 --n 4096 --k 512" s8="--m 8192 --n 8192 --k 1024"
  local small="--m 1024 --n 8192 --k 2048" op shape ab
  run "pull14-test_gemm_rs" 150 env TW_WATCHDOG_S=15 TW_RS_PULL=1 "$bin/test_gemm_rs"
  for op in gemm_rs gemm_ar; do
    for shape in "$s4" "$s8" "$small"; do
      for ab in 0,1 1,0; do
        run "pull14-$op-${shape// /}-$ab" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_PULL=$ab \
          "$bin/tw-bench" $op $shape --repeats 20 --warmup 5
      done
    done
    run "pull14-$op-big" 90 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_PULL=0,1 \
      "$bin/tw-bench" $op $big_rs --repeats 10 --warmup 3
  done
  for shape in "$s4" "$s8"; do
    run "pull14-diag1-${shape// /}" 60 env LD_LIBRARY_PATH="$root/$bin/diag1:$LD_LIBRARY_PATH" \
      TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_rs $shape --repeats 20 --warmup 5 --no-check
  done
}
exp_grp13() { # thirteenth session: one unit group per CTA where ranks share a GPU (the new rule)
  local small="--m 1024 --n 8192 --k 2048" s4="--m 4096 --n 4096 --k 512"
  run "grp13-test_gemm_rs" 150 env TW_WATCHDOG_S=15 "$bin/test_gemm_rs"
  run "grp13-ar-4096" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_GROUP_UNITS=4,2 \
    "$bin/tw-bench" gemm_ar $s4 --repeats 20 --warmup 5
  run "grp13-ar-small" 60 env TW_BENCH_VIRTUAL=1 TW_BENCH_AB=TW_RS_GROUP_UNITS=2,1 \
    "$bin/tw-bench" gemm_ar $small --repeats 20 --warmup 5
  run "grp13-ar-8vr" 90 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" gemm_ar --repeats 20 --warmup 5
}
exp_diag13() { # run in the fourteenth session: the consumers' wait for the previous tile's
  # writes before its signal, against a -DTW_RS_DIAG=64 build in $TW_BUILD_DIR/diag64 that
  # signals after the read-out (results wrong: --no-check). The signal-two-tiles-behind build
  # (128) it also ran hung test_gemm_rs and was removed with its GEMM-core trait.
  local d lib op shape check
  for d in 0 ${TW_DIAG13-64}; do
    lib="$root/$bin"
    [ "$d" = 0 ] || lib="$root/$bin/diag$d"
    [ -e "$lib/libtilewire.so.0" ] || continue
    check=
    [ "$d" = 64 ] && check=--no-check
    for op in gemm_rs gemm_ar; do
      for shape in "--m 4096 --n 4096 --k 512" "--m 8192 --n 8192 --k 1024"; do
        run "diag13-vr-$op-${shape// /}-d$d" 60 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" \
          TW_BENCH_VIRTUAL=1 "$bin/tw-bench" $op $shape --repeats 20 --warmup 5 $check
      done
      [ "$ngpus" -gt 1 ] || continue
      run "diag13-gpus-$op-d$d" 90 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" "$bin/tw-bench" \
        $op --world 2 --repeats 20 --warmup 5 $check
    done
  done
}
exp_none() { # TW_EXP=none: no group (the TW_DIAG_LIBS runs alone)
  :
}
for e in ${TW_EXP:-decode17}; do
  "exp_$e"
done
libs=${TW_DIAG_LIBS-}
for d in ${libs:+0 $libs}; do
  lib="$root/$bin"
  [ "$d" = 0 ] || lib="$root/$bin/diag$d"
  [ -e "$lib/libtilewire.so.0" ] || continue
  check=--no-check
  [ "$d" = 0 ] && check=
  case $d in
  var*) # a build-time variant (diag-lib.sh 0 ... FLAGS), not a measurement build: checked
    check=
    run "test_gemm_rs-diag$d" 200 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" "$bin/test_gemm_rs"
    [ "$ngpus" -gt 1 ] && run "test_gemm_rs-distinct-diag$d" 200 env \
      LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
    ;;
  esac
  if [ "$ngpus" -gt 1 ]; then
    for shape in big flux; do
      args=$flux_rs
      [ $shape = big ] && args=$big_rs
      run "gpus-rs-$shape-diag$d" 60 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" "$bin/tw-bench" \
        gemm_rs --world 2 $args --repeats 20 --warmup 5 $check
    done
  fi
  [ "$d" = 1 ] && continue # on one GPU every store is local already
  [ "${TW_DIAG_VRANKS:-1}" = 1 ] || continue
  run "vranks-rs-big-diag$d" 90 env LD_LIBRARY_PATH="$lib:$LD_LIBRARY_PATH" TW_BENCH_VIRTUAL=1 \
    "$bin/tw-bench" gemm_rs $big_rs --repeats 10 --warmup 3 $check
done
tar czf "$out/experiments.tgz" -C "$out" logs && rm -rf "$out/logs"
printf '%s\n' "${summary[@]}"
