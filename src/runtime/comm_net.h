/*
 * A comm's inter-node transport: where ranks of the comm sit on other nodes, each rank this
 * process drives gets a command FIFO, a backend (transport/net.h: ib or efa, TW_NET) and a CPU
 * proxy thread (transport/proxy.h), and every symmetric allocation is registered with its NICs.
 * A failure the proxy sees becomes the comm's async error (TW_ERR_NETWORK) and aborts its
 * kernels. Within one node none of this exists (comm->net NULL).
 */
#ifndef TW_RUNTIME_COMM_NET_H
#define TW_RUNTIME_COMM_NET_H

#include <stddef.h>

#include "tilewire.h"

struct tw_comm;
struct tw_rail;

/* Sets up the transport of comms[0..n) (the ranks this process drives: all of them in one
 * process, else one), collectively with the other processes, once their control blocks and
 * low-latency areas exist (both are registered here). */
tw_status_t tw_comm_net_init(struct tw_comm **comms, int n);
/* Registers this rank's new allocation and, once every rank this process drives made it, shares
 * the keys (collective with the other processes). */
tw_status_t tw_comm_net_alloc(struct tw_comm *comm, void *ptr, size_t bytes);
void tw_comm_net_free(struct tw_comm *comm, void *ptr);
/* Stops the proxy (after what is in flight), closes the backend, frees the FIFO. */
void tw_comm_net_fini(struct tw_comm *comm);
/* The message of a TW_ERR_NETWORK async error. */
const char *tw_comm_net_error(const struct tw_comm *comm);
/* The rail layout of comm's ranks (tw_rail_t, runtime/devcomm.h). TW_ERR_NOT_SUPPORTED, naming
 * op, where the nodes are not alike (the rail paths need as many ranks on every node) or more
 * than TW_RAIL_MAX_NODES. */
tw_status_t tw_comm_rail(const struct tw_comm *comm, const char *op, struct tw_rail *rail);

#endif
