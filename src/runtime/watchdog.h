/*
 * TW_WATCHDOG_S=N: a host thread that reports tilewire calls that do not finish.
 *
 * Comms made while TW_WATCHDOG_S > 0 keep their TW_TRACE rows in host-mapped memory
 * (comm->trace_live) and are registered here. Every call counts itself enqueued
 * (tw_launch_end) and done (its trace callback, once the stream got past it). When a comm has
 * calls enqueued but none has finished for N seconds since the previous one did, the thread
 * prints, once per stall, what every unfinished CTA of the running kernel is doing, from the
 * live rows (tw_trace_format_live): the bounded wait it spins in, the last GEMM tile its
 * producer claimed and its consumers finished. A CTA stuck in an unbounded wait (the GEMM
 * core's mbarriers) shows as one whose tiles stopped while its peers' went on. Graph replays
 * are not counted as enqueued, so the watchdog does not see them.
 */
#ifndef TW_WATCHDOG_H
#define TW_WATCHDOG_H

struct tw_comm;

void tw_watchdog_add(struct tw_comm *comm);
void tw_watchdog_remove(struct tw_comm *comm);

#endif
