/* Object lifetimes through the C API: use after close, double release, fork.
 *
 * Compiled against the system <infiniband/verbs.h>, linked with -libverbs, run with
 * LD_LIBRARY_PATH pointing at mrkit's libibverbs.so.1 (tests/lifecycle.rs).
 *
 *   lifecycle closed   verbs on a closed context, a second dereg/dealloc: EINVAL, no crash
 *   lifecycle fork     a forked child opens a working device of its own (its own address);
 *                      the parent's objects fail with EINVAL in the child; the parent keeps
 *                      working during and after the child's traffic
 *   lifecycle forkaddr run with MRKIT_ADDR (the parent's address) and MRKIT_CHILD_ADDR: the
 *                      child's device cannot take the parent's address (no GID, the parent
 *                      unaffected) until the child sets MRKIT_ADDR to its own
 *
 * Prints one "ok ..." line per check; the first failed check prints "FAIL ..." and exits 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#include "check.h"
#include "open_mrkit.h"

static void closed(void)
{
	struct ibv_context *ctx = open_mrkit();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL, "ibv_alloc_pd");
	long ps = sysconf(_SC_PAGESIZE);
	char *buf = mmap(NULL, ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(buf != MAP_FAILED, "mmap");
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, ps, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr != NULL, "ibv_reg_mr");
	CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
	errno = 0;
	CHECK(ibv_dereg_mr(mr) == EINVAL && errno == EINVAL, "second ibv_dereg_mr -> EINVAL");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	errno = 0;
	CHECK(ibv_dealloc_pd(pd) == EINVAL && errno == EINVAL, "second ibv_dealloc_pd -> EINVAL");

	/* An MR left registered at close: its dereg after the close is EINVAL. */
	pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL, "ibv_alloc_pd");
	mr = ibv_reg_mr(pd, buf, ps, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr != NULL, "ibv_reg_mr");
	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");

	errno = 0;
	CHECK(ibv_alloc_pd(ctx) == NULL && errno == EINVAL, "ibv_alloc_pd on a closed context -> NULL/EINVAL");
	struct ibv_device_attr attr;
	CHECK(ibv_query_device(ctx, &attr) == EINVAL, "ibv_query_device on a closed context -> EINVAL");
	struct ibv_port_attr pattr;
	CHECK(ibv_query_port(ctx, 1, &pattr) == EINVAL, "ibv_query_port on a closed context -> EINVAL");
	errno = 0;
	CHECK(ibv_create_cq(ctx, 4, NULL, NULL, 0) == NULL && errno == EINVAL,
	      "ibv_create_cq on a closed context -> NULL/EINVAL");
	errno = 0;
	CHECK(ibv_dereg_mr(mr) == EINVAL && errno == EINVAL, "ibv_dereg_mr after its context closed -> EINVAL");
	CHECK(ibv_dealloc_pd(pd) == EINVAL, "ibv_dealloc_pd after its context closed -> EINVAL");
	errno = 0;
	CHECK(ibv_close_device(ctx) == EINVAL && errno == EINVAL, "second ibv_close_device -> EINVAL");

	/* The device still opens and works afterwards. */
	ctx = open_mrkit();
	pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL, "ibv_alloc_pd after reopening");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
	munmap(buf, ps);
}

/* One device's loopback RC pair, an MR of two halves. */
struct rig {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *a, *b;
	struct ibv_mr *mr;
	char *buf;
	size_t len;
	union ibv_gid gid;
};

static void to_rts(struct rig *r, struct ibv_qp *qp, uint32_t dest)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					    IBV_QP_ACCESS_FLAGS) == 0, "QP %u -> INIT", qp->qp_num);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 1;
	a.ah_attr.port_num = 1;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = r->gid;
	a.ah_attr.grh.hop_limit = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
					    IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
	      "QP %u -> RTR", qp->qp_num);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
					    IBV_QP_MAX_QP_RD_ATOMIC) == 0,
	      "QP %u -> RTS", qp->qp_num);
}

static void rig_up(struct rig *r)
{
	r->ctx = open_mrkit();
	CHECK(ibv_query_gid(r->ctx, 1, 0, &r->gid) == 0, "ibv_query_gid");
	r->pd = ibv_alloc_pd(r->ctx);
	CHECK(r->pd != NULL, "ibv_alloc_pd");
	r->cq = ibv_create_cq(r->ctx, 16, NULL, NULL, 0);
	CHECK(r->cq != NULL, "ibv_create_cq");
	struct ibv_qp_init_attr ia = {
		.send_cq = r->cq, .recv_cq = r->cq,
		.cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
	};
	r->a = ibv_create_qp(r->pd, &ia);
	r->b = ibv_create_qp(r->pd, &ia);
	CHECK(r->a && r->b, "ibv_create_qp x2");
	to_rts(r, r->a, r->b->qp_num);
	to_rts(r, r->b, r->a->qp_num);
	r->len = 2 * 4096;
	r->buf = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(r->buf != MAP_FAILED, "mmap");
	r->mr = ibv_reg_mr(r->pd, r->buf, r->len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(r->mr != NULL, "ibv_reg_mr");
}

/* RDMA WRITE `pattern` from the first half to the second over QP a -> b; check the bytes. */
static void rig_write(struct rig *r, char pattern, const char *who)
{
	size_t half = r->len / 2;
	memset(r->buf, pattern, half);
	memset(r->buf + half, 0, half);
	struct ibv_sge sge = { .addr = (uintptr_t)r->buf, .length = half, .lkey = r->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED };
	wr.wr.rdma.remote_addr = (uintptr_t)(r->buf + half);
	wr.wr.rdma.rkey = r->mr->rkey;
	struct ibv_send_wr *bad = NULL;
	CHECK(ibv_post_send(r->a, &wr, &bad) == 0, "%s: post RDMA WRITE", who);
	struct ibv_wc wc;
	int n = 0;
	for (int i = 0; i < 10000000 && n == 0; i++) {
		n = ibv_poll_cq(r->cq, 1, &wc);
		if (n == 0)
			usleep(10);
	}
	CHECK(n == 1 && wc.status == IBV_WC_SUCCESS && wc.wr_id == 7,
	      "%s: RDMA WRITE completed (n %d, status %d)", who, n, n == 1 ? (int)wc.status : -1);
	for (size_t i = 0; i < half; i++)
		if (r->buf[half + i] != pattern)
			CHECK(0, "%s: byte %zu is %#x, not %#x", who, i, r->buf[half + i], pattern);
	CHECK(1, "%s: %zu bytes landed", who, half);
}

static void do_fork(void)
{
	struct rig p;
	rig_up(&p);
	rig_write(&p, 0x11, "parent before fork");

	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		/* The parent's objects: refused, nothing crashes, nothing reaches the parent. */
		errno = 0;
		CHECK(ibv_alloc_pd(p.ctx) == NULL && errno == EINVAL,
		      "child: ibv_alloc_pd on the parent's context -> NULL/EINVAL");
		struct ibv_sge sge = { .addr = (uintptr_t)p.buf, .length = 16, .lkey = p.mr->lkey };
		struct ibv_send_wr wr = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND };
		struct ibv_send_wr *bad = NULL;
		CHECK(ibv_post_send(p.a, &wr, &bad) == EINVAL && bad == &wr,
		      "child: ibv_post_send on the parent's QP -> EINVAL");
		struct ibv_wc wc;
		CHECK(ibv_poll_cq(p.cq, 1, &wc) < 0, "child: ibv_poll_cq on the parent's CQ fails");
		CHECK(ibv_dereg_mr(p.mr) == EINVAL, "child: ibv_dereg_mr of the parent's MR -> EINVAL");
		CHECK(ibv_close_device(p.ctx) == 0, "child: ibv_close_device of the parent's context");
		errno = 0;
		CHECK(ibv_alloc_pd(p.ctx) == NULL && errno == EINVAL,
		      "child: the closed parent's context stays refused");

		/* A device of its own, with its own address, that works. */
		struct rig c;
		rig_up(&c);
		CHECK(memcmp(&c.gid, &p.gid, sizeof(c.gid)) != 0,
		      "child: its own GID (not the parent's address)");
		for (int i = 0; i < 20; i++)
			rig_write(&c, (char)(0x40 + i), "child");
		CHECK(ibv_dereg_mr(c.mr) == 0, "child: ibv_dereg_mr");
		CHECK(ibv_destroy_qp(c.a) == 0 && ibv_destroy_qp(c.b) == 0, "child: ibv_destroy_qp");
		CHECK(ibv_destroy_cq(c.cq) == 0, "child: ibv_destroy_cq");
		CHECK(ibv_dealloc_pd(c.pd) == 0, "child: ibv_dealloc_pd");
		CHECK(ibv_close_device(c.ctx) == 0, "child: ibv_close_device");
		printf("child done\n");
		fflush(stdout);
		exit(0);
	}
	/* The parent keeps working while the child runs, and after. */
	for (int i = 0; i < 20; i++)
		rig_write(&p, (char)(0x20 + i), "parent during child");
	int status = 0;
	CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exited 0 (status %#x)", status);
	rig_write(&p, 0x33, "parent after child");
	CHECK(ibv_dereg_mr(p.mr) == 0, "ibv_dereg_mr");
	CHECK(ibv_destroy_qp(p.a) == 0 && ibv_destroy_qp(p.b) == 0, "ibv_destroy_qp");
	CHECK(ibv_destroy_cq(p.cq) == 0, "ibv_destroy_cq");
	CHECK(ibv_dealloc_pd(p.pd) == 0, "ibv_dealloc_pd");
	CHECK(ibv_close_device(p.ctx) == 0, "ibv_close_device");
}

static void fork_addr(void)
{
	struct rig p;
	rig_up(&p);
	rig_write(&p, 0x11, "parent before fork");
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		struct ibv_context *c = open_mrkit();
		union ibv_gid g;
		CHECK(ibv_query_gid(c, 1, 0, &g) != 0,
		      "child: the inherited MRKIT_ADDR is the parent's: no GID for the child");
		CHECK(ibv_close_device(c) == 0, "child: ibv_close_device");
		const char *mine = getenv("MRKIT_CHILD_ADDR");
		CHECK(mine && setenv("MRKIT_ADDR", mine, 1) == 0, "child: MRKIT_ADDR=%s", mine);
		struct rig k;
		rig_up(&k);
		CHECK(memcmp(&k.gid, &p.gid, sizeof(k.gid)) != 0, "child: its own GID");
		for (int i = 0; i < 10; i++)
			rig_write(&k, (char)(0x40 + i), "child");
		CHECK(ibv_close_device(k.ctx) == 0, "child: ibv_close_device");
		exit(0);
	}
	for (int i = 0; i < 10; i++)
		rig_write(&p, (char)(0x20 + i), "parent during child");
	int status = 0;
	CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exited 0 (status %#x)", status);
	rig_write(&p, 0x33, "parent after child");
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	const char *mode = argc > 1 ? argv[1] : "";
	if (strcmp(mode, "closed") == 0)
		closed();
	else if (strcmp(mode, "fork") == 0)
		do_fork();
	else if (strcmp(mode, "forkaddr") == 0)
		fork_addr();
	else {
		fprintf(stderr, "usage: lifecycle closed|fork|forkaddr\n");
		return 2;
	}
	printf("all checks passed\n");
	return 0;
}
