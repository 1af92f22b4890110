/* Device async events through ibv_get_async_event / ibv_ack_async_event, and the destroy
 * semantics that go with them (rdma-core: ibv_destroy_{qp,cq,srq} wait until every event
 * handed out for the object was acked; unread events are dropped by the destroy).
 *
 * Compiled against the system <infiniband/verbs.h> and linked with -libverbs (rdma-core v44),
 * then run with LD_LIBRARY_PATH pointing at mrkit's libibverbs.so.1 (tests/async_events.rs).
 * QPs are connected in-process (no GRH: mrkit0's in-process loopback).
 *
 *   async_events srq      SRQ limit (ibv_modify_srq IBV_SRQ_LIMIT, then consume receives),
 *                         QP → ERR on an SRQ QP (LAST_WQE_REACHED), poll()/O_NONBLOCK on
 *                         async_fd, a second context sees nothing, destroy waits for the ack
 *   async_events cq       CQ overflow: CQ_ERR (element = the CQ) then QP_FATAL (the QP);
 *                         ibv_destroy_cq waits for the CQ_ERR ack
 *   async_events unread   an event never read is dropped by the destroy (no wait, no delivery)
 *   async_events comp     ibv_destroy_cq waits for ibv_ack_cq_events of returned CQ events
 *
 * Prints one "ok ..." line per check; the first failed check prints "FAIL ..." and exits 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#include "check.h"
#include "open_mrkit.h"

static char buf[1 << 16];

struct env {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
};

static struct env setup(void)
{
	struct env e;
	e.ctx = open_mrkit();
	e.pd = ibv_alloc_pd(e.ctx);
	CHECK(e.pd != NULL, "ibv_alloc_pd");
	e.mr = ibv_reg_mr(e.pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	CHECK(e.mr != NULL, "ibv_reg_mr");
	return e;
}

static struct ibv_qp *rc_qp(struct env *e, struct ibv_cq *scq, struct ibv_cq *rcq,
			    struct ibv_srq *srq)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = scq,
		.recv_cq = rcq,
		.srq = srq,
		.cap = { .max_send_wr = 16, .max_recv_wr = srq ? 0 : 16, .max_send_sge = 1,
			 .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(e->pd, &ia);
	CHECK(qp != NULL, "ibv_create_qp%s", srq ? " (SRQ)" : "");
	return qp;
}

static void to_rts(struct ibv_qp *qp, uint32_t dest)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					    IBV_QP_ACCESS_FLAGS) == 0,
	      "QP %u → INIT", qp->qp_num);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 1;
	a.ah_attr.port_num = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
					    IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
	      "QP %u → RTR", qp->qp_num);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
					    IBV_QP_MAX_QP_RD_ATOMIC) == 0,
	      "QP %u → RTS", qp->qp_num);
}

static void connect_pair(struct ibv_qp *a, struct ibv_qp *b)
{
	to_rts(a, b->qp_num);
	to_rts(b, a->qp_num);
}

static void to_err(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0, "QP %u → ERR", qp->qp_num);
}

static void post_send(struct env *e, struct ibv_qp *qp, uint64_t id, int n)
{
	for (int i = 0; i < n; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 16, .lkey = e->mr->lkey };
		struct ibv_send_wr wr = { .wr_id = id + i, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
		struct ibv_send_wr *bad = NULL;
		CHECK(ibv_post_send(qp, &wr, &bad) == 0, "post SEND %lu", (unsigned long)(id + i));
	}
}

/* Post n receives (64 bytes each) to the SRQ if srq is set, else to the QP's RQ. */
static void post_recvs_to(struct env *e, struct ibv_qp *qp, struct ibv_srq *srq, int n)
{
	for (int i = 0; i < n; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf + 1024, .length = 64,
				       .lkey = e->mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1 };
		struct ibv_recv_wr *bad = NULL;
		int r = srq ? ibv_post_srq_recv(srq, &wr, &bad) : ibv_post_recv(qp, &wr, &bad);
		CHECK(r == 0, "post %s receive %d", srq ? "SRQ" : "QP", i);
	}
}

/* Poll until n completions arrived (5 s at most); returns how many had status SUCCESS. */
static int poll_n(struct ibv_cq *cq, int n)
{
	struct ibv_wc wc[16];
	int got = 0, ok = 0;
	for (int spins = 0; got < n && spins < 50000; spins++) {
		int r = ibv_poll_cq(cq, 16, wc);
		if (r < 0)
			CHECK(0, "ibv_poll_cq: %d", r);
		for (int i = 0; i < r; i++)
			ok += wc[i].status == IBV_WC_SUCCESS;
		got += r;
		if (r == 0)
			usleep(100);
	}
	CHECK(got == n, "%d completion(s) polled", n);
	return ok;
}

static int fd_ready(int fd, int timeout_ms)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	int r = poll(&p, 1, timeout_ms);
	return r == 1 && (p.revents & POLLIN);
}

/* Wait (poll, 5 s) for the next async event and return it (not acked). */
static struct ibv_async_event next_event(struct ibv_context *ctx)
{
	struct ibv_async_event ev;
	CHECK(fd_ready(ctx->async_fd, 5000), "async_fd %d readable", ctx->async_fd);
	CHECK(ibv_get_async_event(ctx, &ev) == 0, "ibv_get_async_event: %s",
	      ibv_event_type_str(ev.event_type));
	return ev;
}

static void set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	CHECK(fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0, "O_NONBLOCK on fd %d", fd);
}

static void expect_eagain(struct ibv_context *ctx)
{
	struct ibv_async_event ev;
	errno = 0;
	int r = ibv_get_async_event(ctx, &ev);
	CHECK(r == -1 && errno == EAGAIN, "ibv_get_async_event on an empty non-blocking fd: "
					  "-1/EAGAIN (got %d)", r);
}

/* ---- destroy in a thread, check that it waits for the ack ---- */

enum kind { K_QP, K_CQ, K_SRQ };

struct destroyer {
	enum kind kind;
	void *obj;
	int ret;
	int done; /* written by the thread with __atomic_store_n */
};

static void *destroy_thread(void *arg)
{
	struct destroyer *d = arg;
	switch (d->kind) {
	case K_QP: d->ret = ibv_destroy_qp(d->obj); break;
	case K_CQ: d->ret = ibv_destroy_cq(d->obj); break;
	case K_SRQ: d->ret = ibv_destroy_srq(d->obj); break;
	}
	__atomic_store_n(&d->done, 1, __ATOMIC_RELEASE);
	return NULL;
}

static const char *kname(enum kind k)
{
	return k == K_QP ? "QP" : k == K_CQ ? "CQ" : "SRQ";
}

/* Start destroying obj; check it is still blocked after 300 ms; run ack(); check that the
 * destroy then returns 0. */
static void destroy_waits_for(enum kind kind, void *obj, void (*ack)(void *), void *ack_arg)
{
	struct destroyer d = { .kind = kind, .obj = obj };
	pthread_t t;
	CHECK(pthread_create(&t, NULL, destroy_thread, &d) == 0, "start destroy thread");
	usleep(300 * 1000);
	CHECK(!__atomic_load_n(&d.done, __ATOMIC_ACQUIRE),
	      "ibv_destroy_%s blocks while an event is not acked", kname(kind));
	ack(ack_arg);
	pthread_join(t, NULL);
	CHECK(d.done && d.ret == 0, "ibv_destroy_%s returns 0 after the ack", kname(kind));
}

static void ack_async(void *ev)
{
	ibv_ack_async_event(ev);
}

/* ---- scenarios ---- */

static void test_srq(void)
{
	struct env e = setup();
	struct ibv_context *other = open_mrkit();
	CHECK(e.ctx->async_fd >= 0 && e.ctx->async_fd != other->async_fd,
	      "each context has its own async_fd (%d, %d)", e.ctx->async_fd, other->async_fd);
	CHECK(!fd_ready(e.ctx->async_fd, 0), "async_fd not readable before any event");

	struct ibv_cq *rcq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	struct ibv_cq *scq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(rcq && scq, "ibv_create_cq ×2");
	int marker;
	struct ibv_srq_init_attr sia = { .srq_context = &marker,
					 .attr = { .max_wr = 16, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(e.pd, &sia);
	CHECK(srq != NULL, "ibv_create_srq");
	post_recvs_to(&e, NULL, srq, 10);
	struct ibv_srq_attr sa = { .srq_limit = 8 };
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0, "ibv_modify_srq IBV_SRQ_LIMIT 8");

	struct ibv_qp *r = rc_qp(&e, rcq, rcq, srq);
	struct ibv_qp *s = rc_qp(&e, scq, scq, NULL);
	connect_pair(r, s);

	post_send(&e, s, 1, 2); /* 10 → 8 WQEs left: not below the limit */
	CHECK(poll_n(scq, 2) == 2 && poll_n(rcq, 2) == 2, "two SENDs received from the SRQ");
	usleep(50 * 1000);
	CHECK(!fd_ready(e.ctx->async_fd, 0), "no event while 8 WQEs (= limit) remain");

	post_send(&e, s, 3, 1); /* 7 left: below 8 → SRQ_LIMIT_REACHED */
	CHECK(poll_n(scq, 1) == 1 && poll_n(rcq, 1) == 1, "third SEND received");
	struct ibv_async_event ev = next_event(e.ctx);
	CHECK(ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED, "event_type SRQ_LIMIT_REACHED (%d)",
	      ev.event_type);
	CHECK(ev.element.srq == srq, "element.srq is the application's ibv_srq (%p)",
	      (void *)ev.element.srq);
	CHECK(ev.element.srq->srq_context == &marker, "… with its srq_context");
	CHECK(!fd_ready(e.ctx->async_fd, 0), "async_fd drained after one event");
	CHECK(!fd_ready(other->async_fd, 0), "the other context's async_fd saw nothing");
	CHECK(ibv_query_srq(srq, &sa) == 0 && sa.srq_limit == 0,
	      "the limit disarmed after firing (srq_limit %u)", sa.srq_limit);
	set_nonblock(e.ctx->async_fd);
	expect_eagain(e.ctx);
	/* Acked right away: counted once. */
	unsigned before = srq->events_completed;
	ibv_ack_async_event(&ev);
	CHECK(srq->events_completed == before + 1, "ibv_ack_async_event: srq->events_completed "
						   "%u → %u", before, srq->events_completed);

	/* Re-arm, fire again, keep it un-acked for the destroy check below. */
	sa.srq_limit = 7;
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0, "re-arm IBV_SRQ_LIMIT 7");
	post_send(&e, s, 4, 1); /* 6 left */
	CHECK(poll_n(scq, 1) == 1 && poll_n(rcq, 1) == 1, "fourth SEND received");
	struct ibv_async_event srq_ev = next_event(e.ctx);
	CHECK(srq_ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && srq_ev.element.srq == srq,
	      "second SRQ_LIMIT_REACHED for the same SRQ");

	/* QP → ERR on an SRQ QP: LAST_WQE_REACHED, element = the QP. */
	to_err(r);
	struct ibv_async_event qp_ev = next_event(e.ctx);
	CHECK(qp_ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED,
	      "event_type QP_LAST_WQE_REACHED (%d)", qp_ev.event_type);
	CHECK(qp_ev.element.qp == r, "element.qp is the application's ibv_qp");
	expect_eagain(e.ctx);

	destroy_waits_for(K_QP, r, ack_async, &qp_ev);
	CHECK(ibv_destroy_qp(s) == 0, "destroy the sender QP (no events)");
	destroy_waits_for(K_SRQ, srq, ack_async, &srq_ev);
	CHECK(ibv_destroy_cq(rcq) == 0 && ibv_destroy_cq(scq) == 0, "destroy the CQs");
	CHECK(ibv_dereg_mr(e.mr) == 0 && ibv_dealloc_pd(e.pd) == 0, "dereg MR, dealloc PD");
	CHECK(ibv_close_device(other) == 0 && ibv_close_device(e.ctx) == 0, "close contexts");
}

static void test_cq(void)
{
	struct env e = setup();
	struct ibv_cq *small = ibv_create_cq(e.ctx, 1, NULL, NULL, 0);
	struct ibv_cq *big = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(small && big, "a CQ of 1 entry and one of 64");
	struct ibv_qp *a = rc_qp(&e, small, big, NULL);
	struct ibv_qp *b = rc_qp(&e, big, big, NULL);
	connect_pair(a, b);
	post_recvs_to(&e, b, NULL, 4);
	post_send(&e, a, 1, 3); /* 3 send completions into a CQ of 1: overflow */

	struct ibv_async_event cq_ev = next_event(e.ctx);
	CHECK(cq_ev.event_type == IBV_EVENT_CQ_ERR, "event_type CQ_ERR (%d)", cq_ev.event_type);
	CHECK(cq_ev.element.cq == small, "element.cq is the overflowed ibv_cq");
	struct ibv_async_event qp_ev = next_event(e.ctx);
	CHECK(qp_ev.event_type == IBV_EVENT_QP_FATAL, "then QP_FATAL (%d)", qp_ev.event_type);
	CHECK(qp_ev.element.qp == a, "element.qp is the QP whose completion overflowed");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	CHECK(ibv_query_qp(a, &qa, IBV_QP_STATE, &qia) == 0 && qa.qp_state == IBV_QPS_ERR,
	      "the QP is in ERR");

	unsigned before = a->events_completed;
	ibv_ack_async_event(&qp_ev);
	CHECK(a->events_completed == before + 1, "qp->events_completed counted the ack");
	CHECK(ibv_destroy_qp(a) == 0, "ibv_destroy_qp after the ack returns at once");
	CHECK(ibv_destroy_qp(b) == 0, "destroy the peer QP");
	destroy_waits_for(K_CQ, small, ack_async, &cq_ev);
	CHECK(ibv_destroy_cq(big) == 0, "destroy the other CQ");
	CHECK(ibv_dereg_mr(e.mr) == 0 && ibv_dealloc_pd(e.pd) == 0, "dereg MR, dealloc PD");
	CHECK(ibv_close_device(e.ctx) == 0, "close");
}

static void test_unread(void)
{
	struct env e = setup();
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	struct ibv_srq_init_attr sia = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(e.pd, &sia);
	CHECK(cq && srq, "CQ and SRQ");
	struct ibv_qp *r = rc_qp(&e, cq, cq, srq);
	struct ibv_qp *s = rc_qp(&e, cq, cq, NULL);
	connect_pair(r, s);
	to_err(r);
	CHECK(fd_ready(e.ctx->async_fd, 5000), "LAST_WQE_REACHED queued (async_fd readable)");
	CHECK(ibv_destroy_qp(r) == 0, "ibv_destroy_qp with the event unread: no wait");
	set_nonblock(e.ctx->async_fd);
	expect_eagain(e.ctx); /* the destroyed QP's event is gone */
	CHECK(ibv_destroy_qp(s) == 0 && ibv_destroy_srq(srq) == 0 && ibv_destroy_cq(cq) == 0,
	      "destroy the rest");
	CHECK(ibv_dereg_mr(e.mr) == 0 && ibv_dealloc_pd(e.pd) == 0, "dereg MR, dealloc PD");
	CHECK(ibv_close_device(e.ctx) == 0, "close");
}

static void ack_cq(void *cq)
{
	ibv_ack_cq_events(cq, 1);
}

static void test_comp(void)
{
	struct env e = setup();
	struct ibv_comp_channel *ch = ibv_create_comp_channel(e.ctx);
	CHECK(ch != NULL, "ibv_create_comp_channel");
	struct ibv_cq *cq = ibv_create_cq(e.ctx, 64, NULL, ch, 0);
	struct ibv_cq *other = ibv_create_cq(e.ctx, 64, NULL, NULL, 0);
	CHECK(cq && other, "CQs");
	struct ibv_qp *a = rc_qp(&e, cq, other, NULL);
	struct ibv_qp *b = rc_qp(&e, other, other, NULL);
	connect_pair(a, b);
	post_recvs_to(&e, b, NULL, 1);
	CHECK(ibv_req_notify_cq(cq, 0) == 0, "ibv_req_notify_cq");
	post_send(&e, a, 1, 1);
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx = NULL;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq, "ibv_get_cq_event");
	CHECK(poll_n(cq, 1) == 1, "the send completion");
	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy the QPs");
	destroy_waits_for(K_CQ, cq, ack_cq, cq);
	CHECK(ibv_destroy_cq(other) == 0 && ibv_destroy_comp_channel(ch) == 0,
	      "destroy the other CQ and the channel");
	CHECK(ibv_dereg_mr(e.mr) == 0 && ibv_dealloc_pd(e.pd) == 0, "dereg MR, dealloc PD");
	CHECK(ibv_close_device(e.ctx) == 0, "close");
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	const char *what = argc > 1 ? argv[1] : "";
	if (!strcmp(what, "srq"))
		test_srq();
	else if (!strcmp(what, "cq"))
		test_cq();
	else if (!strcmp(what, "unread"))
		test_unread();
	else if (!strcmp(what, "comp"))
		test_comp();
	else {
		fprintf(stderr, "usage: async_events srq|cq|unread|comp\n");
		return 2;
	}
	printf("all checks passed\n");
	return 0;
}
