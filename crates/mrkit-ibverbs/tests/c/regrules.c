/* Registration rules of mrkit0 checked through the C API of libibverbs.
 *
 * Compiled against the system <infiniband/verbs.h> and linked with -libverbs (rdma-core v44),
 * then run with LD_LIBRARY_PATH pointing at mrkit's libibverbs.so.1 (tests/tools.rs).
 *
 *   regrules basic          everything that needs no special environment
 *   regrules maxmr N        run with MRKIT_MAX_MR=N: N registrations succeed, the next is ENOMEM
 *   regrules noodp          run with MRKIT_ODP=0: ON_DEMAND is EOPNOTSUPP, no ODP caps
 *
 * Prints one "ok ..." line per check; the first failed check prints "FAIL ..." and exits 1.
 * Freed objects are never touched again (real libibverbs frees them too).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <unistd.h>
#include <infiniband/verbs.h>

static int failed;

#include "check.h"

/* Runtime access values (not compile-time constants), as programs usually pass them. */
static volatile int v_access;
static int acc(int a) { v_access = a; return v_access; }

static struct ibv_context *open_mrkit(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1, "ibv_get_device_list: %d device(s)", n);
	CHECK(strcmp(ibv_get_device_name(list[0]), "mrkit0") == 0, "device name mrkit0");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx != NULL, "ibv_open_device");
	ibv_free_device_list(list);
	return ctx;
}

static void *page_buf(size_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(p != MAP_FAILED, "mmap %zu bytes", len);
	memset(p, 0xab, len);
	return p;
}

/* Expect registration failure with errno `e`. */
static void expect_reg_fail(struct ibv_mr *mr, int e, const char *what)
{
	int got = errno;
	CHECK(mr == NULL && got == e, "%s -> NULL, errno %s (got %d)", what, strerror(e), got);
}

static void basic(void)
{
	struct ibv_context *ctx = open_mrkit();
	long ps = sysconf(_SC_PAGESIZE);
	size_t len = 4 * ps;
	char *buf = page_buf(len);

	/* device and port through the inline wrappers (verbs_context ops) */
	struct ibv_device_attr_ex ax;
	memset(&ax, 0, sizeof(ax));
	CHECK(ibv_query_device_ex(ctx, NULL, &ax) == 0, "ibv_query_device_ex");
	CHECK(ax.orig_attr.vendor_id != 0 && ax.orig_attr.vendor_part_id == 0,
	      "vendor_id %#x (non-zero), vendor_part_id 0", ax.orig_attr.vendor_id);
	CHECK(ax.orig_attr.max_mr > 0 && ax.orig_attr.max_pd > 0 && ax.orig_attr.phys_port_cnt == 1,
	      "max_mr %d max_pd %d ports %d", ax.orig_attr.max_mr, ax.orig_attr.max_pd,
	      ax.orig_attr.phys_port_cnt);
	CHECK((ax.odp_caps.general_caps & IBV_ODP_SUPPORT) &&
		      (ax.odp_caps.per_transport_caps.rc_odp_caps & IBV_ODP_SUPPORT_SEND),
	      "ODP caps general %#llx rc %#x", (unsigned long long)ax.odp_caps.general_caps,
	      ax.odp_caps.per_transport_caps.rc_odp_caps);
	CHECK(ax.phys_port_cnt_ex == 1, "phys_port_cnt_ex 1");
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 1, &pa) == 0, "ibv_query_port");
	CHECK(pa.state == IBV_PORT_ACTIVE && pa.link_layer == IBV_LINK_LAYER_ETHERNET &&
		      pa.active_mtu == IBV_MTU_4096 && pa.max_mtu == IBV_MTU_4096 &&
		      pa.gid_tbl_len == 1,
	      "port ACTIVE, Ethernet, MTU 4096/4096 (loopback address), 1 GID");
	CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL, "ibv_query_port(port 2) -> EINVAL");
	union ibv_gid gid;
	CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0 && gid.raw[10] == 0xff && gid.raw[11] == 0xff &&
		      gid.raw[12] == 127,
	      "GID[0] is IPv4-mapped 127.0.0.x");
	struct ibv_gid_entry ge;
	CHECK(ibv_query_gid_ex(ctx, 1, 0, &ge, 0) == 0 && ge.gid_type == IBV_GID_TYPE_ROCE_V2,
	      "ibv_query_gid_ex: RoCE v2");

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL, "ibv_alloc_pd");
	struct ibv_pd *pd2 = ibv_alloc_pd(ctx);
	CHECK(pd2 != NULL, "ibv_alloc_pd (second)");

	/* validation order and errnos */
	errno = 0;
	expect_reg_fail(ibv_reg_mr(pd, buf, len, acc(IBV_ACCESS_REMOTE_WRITE)), EINVAL,
			"REMOTE_WRITE without LOCAL_WRITE");
	expect_reg_fail(ibv_reg_mr(pd, buf, len, acc(IBV_ACCESS_REMOTE_ATOMIC)), EINVAL,
			"REMOTE_ATOMIC without LOCAL_WRITE");
	expect_reg_fail(ibv_reg_mr(pd, buf, len, acc(IBV_ACCESS_LOCAL_WRITE | 0x400)), EINVAL,
			"unknown access bit 0x400");
	expect_reg_fail(ibv_reg_mr_iova(pd, buf + 8, ps, 0x10000, acc(IBV_ACCESS_LOCAL_WRITE)),
			EINVAL, "reg_mr_iova with a page-offset mismatch");
	expect_reg_fail(ibv_reg_mr(pd, buf, 0, acc(IBV_ACCESS_LOCAL_WRITE)), EINVAL, "length 0");
	void *ro = mmap(NULL, ps, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(ro != MAP_FAILED, "read-only mmap");
	expect_reg_fail(ibv_reg_mr(pd, ro, ps, acc(IBV_ACCESS_LOCAL_WRITE)), EFAULT,
			"read-only mapping with LOCAL_WRITE");
	struct ibv_mr *romr = ibv_reg_mr(pd, ro, ps, acc(IBV_ACCESS_REMOTE_READ));
	CHECK(romr != NULL, "read-only mapping with REMOTE_READ only");
	CHECK(ibv_dereg_mr(romr) == 0, "dereg read-only MR");
	munmap(ro, ps);

	/* a good registration */
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, len,
				       acc(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
					   IBV_ACCESS_REMOTE_READ));
	CHECK(mr != NULL, "reg_mr LOCAL_WRITE|REMOTE_WRITE|REMOTE_READ");
	CHECK(mr->lkey == mr->rkey && mr->lkey != 0, "lkey == rkey (%#x)", mr->lkey);
	CHECK(mr->addr == buf && mr->length == len && mr->pd == pd && mr->context == ctx,
	      "ibv_mr fields");
	/* compile-time constant access: the verbs.h macro calls ibv_reg_mr@IBVERBS_1.1 directly
	 * (a runtime value goes through ibv_reg_mr_iova2) */
	struct ibv_mr *cmr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
	CHECK(cmr != NULL && cmr->lkey == cmr->rkey, "reg_mr with a constant access (ibv_reg_mr@1.1)");
	CHECK(ibv_dereg_mr(cmr) == 0, "dereg");
	struct ibv_mr *ro_mr = ibv_reg_mr(pd, buf, len, acc(IBV_ACCESS_LOCAL_WRITE |
							   IBV_ACCESS_RELAXED_ORDERING));
	CHECK(ro_mr != NULL, "RELAXED_ORDERING (optional range) is ignored, not rejected");
	CHECK(ro_mr->lkey != mr->lkey, "two MRs over one buffer have different keys");
	CHECK(ibv_dereg_mr(ro_mr) == 0, "dereg");
	struct ibv_mr *iova_mr = ibv_reg_mr_iova(pd, buf + 16, ps, 0x7000010,
						 acc(IBV_ACCESS_LOCAL_WRITE));
	CHECK(iova_mr != NULL && iova_mr->addr == buf + 16, "reg_mr_iova with matching page offset");
	CHECK(ibv_dereg_mr(iova_mr) == 0, "dereg iova MR");
	struct ibv_mr *odp = ibv_reg_mr(pd, buf, len, acc(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND));
	CHECK(odp != NULL, "ON_DEMAND registration");
	CHECK(ibv_dereg_mr(odp) == 0, "dereg ODP MR");

	/* dealloc_pd while in use */
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc_pd with a live MR -> EBUSY");

	/* rereg: library input checks (ERR_INPUT, errno EINVAL, MR unchanged) */
	uint32_t key = mr->lkey;
	errno = 0;
	CHECK(ibv_rereg_mr(mr, 0x8, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT && errno == EINVAL,
	      "rereg unknown flag -> ERR_INPUT/EINVAL");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, len, 0) ==
			      IBV_REREG_MR_ERR_INPUT && errno == EINVAL,
	      "rereg TRANSLATION with NULL addr -> ERR_INPUT/EINVAL");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, pd2, NULL, 0, IBV_ACCESS_LOCAL_WRITE) ==
			      IBV_REREG_MR_ERR_INPUT && errno == EINVAL,
	      "rereg access without CHANGE_ACCESS -> ERR_INPUT/EINVAL");
	/* device checks (ERR_CMD with the device's errno) */
	errno = 0;
	CHECK(ibv_rereg_mr(mr, 0, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_CMD && errno == EINVAL,
	      "rereg flags 0 -> ERR_CMD/EINVAL");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_REMOTE_WRITE) == IBV_REREG_MR_ERR_CMD && errno == EINVAL,
	      "rereg to REMOTE_WRITE without LOCAL_WRITE -> ERR_CMD/EINVAL");
	CHECK(mr->lkey == key, "failed rereg kept the keys");
	/* successful in-place changes keep the keys */
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) == 0,
	      "rereg CHANGE_ACCESS");
	CHECK(mr->lkey == key && mr->rkey == key, "CHANGE_ACCESS keeps lkey/rkey");
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, pd2, NULL, 0, 0) == 0 && mr->pd == pd2,
	      "rereg CHANGE_PD moves the MR to pd2");
	CHECK(ibv_dealloc_pd(pd) == 0, "dealloc_pd after its only MR moved away");
	pd = NULL;
	/* CHANGE_TRANSLATION: new buffer, new keys */
	char *buf2 = page_buf(len);
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, buf2, len, 0) == 0,
	      "rereg CHANGE_TRANSLATION");
	CHECK(mr->addr == buf2 && mr->length == len && mr->lkey == mr->rkey,
	      "TRANSLATION updated addr/length (lkey %#x, was %#x)", mr->lkey, key);

	/* EACCES: upgrading a read-only pin to writable in place (CVE-2026-52908 rule) */
	struct ibv_mr *rmr = ibv_reg_mr(pd2, buf, ps, acc(IBV_ACCESS_REMOTE_READ));
	CHECK(rmr != NULL, "reg_mr REMOTE_READ only (read-only pin)");
	errno = 0;
	CHECK(ibv_rereg_mr(rmr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE) == IBV_REREG_MR_ERR_CMD && errno == EACCES,
	      "rereg read-only pin to LOCAL_WRITE -> ERR_CMD/EACCES");
	CHECK(ibv_rereg_mr(rmr, IBV_REREG_MR_CHANGE_ACCESS | IBV_REREG_MR_CHANGE_TRANSLATION, NULL,
			   buf, ps, IBV_ACCESS_LOCAL_WRITE) == 0,
	      "... but allowed together with a new translation");
	CHECK(ibv_dereg_mr(rmr) == 0, "dereg");

	/* dereg invalidates the key: a later registration never gets the stale key back */
	uint32_t stale = mr->lkey;
	struct ibv_mr copy = *mr; /* a stack copy: never freed by anyone */
	CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
	/* mr is freed now; the copy carries the stale key. mrkit's library rejects it without
	 * touching (or freeing) the struct. (Real libibverbs would free() it: don't do this there.) */
	errno = 0;
	CHECK(ibv_dereg_mr(&copy) == EINVAL, "second dereg of the same key -> EINVAL");
	errno = 0;
	CHECK(ibv_rereg_mr(&copy, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE) == IBV_REREG_MR_ERR_CMD && errno == EINVAL,
	      "rereg of a deregistered key -> ERR_CMD/EINVAL");
	struct ibv_mr *again = ibv_reg_mr(pd2, buf, len, acc(IBV_ACCESS_LOCAL_WRITE));
	CHECK(again != NULL && again->lkey != stale, "new MR after dereg: key %#x != stale %#x",
	      again ? again->lkey : 0, stale);

	/* memory windows through ctx->ops */
	struct ibv_mw *mw = ibv_alloc_mw(pd2, IBV_MW_TYPE_2);
	CHECK(mw != NULL && mw->rkey != 0 && mw->pd == pd2 && mw->type == IBV_MW_TYPE_2,
	      "ibv_alloc_mw type 2 (rkey %#x)", mw ? mw->rkey : 0);
	struct ibv_mw *mw1 = ibv_alloc_mw(pd2, IBV_MW_TYPE_1);
	CHECK(mw1 != NULL, "ibv_alloc_mw type 1");
	CHECK(ibv_dealloc_mw(mw1) == 0, "ibv_dealloc_mw type 1");
	CHECK(ibv_dereg_mr(again) == 0, "dereg");
	CHECK(ibv_dealloc_pd(pd2) == EBUSY, "dealloc_pd with a live MW -> EBUSY");
	CHECK(ibv_dealloc_mw(mw) == 0, "ibv_dealloc_mw");
	CHECK(ibv_dealloc_pd(pd2) == 0, "dealloc_pd");

	/* CQs (data path): real; objects not made by the library fail cleanly (EINVAL), no crash */
	errno = 0;
	CHECK(ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL,
	      "ibv_create_cq(cqe 0) -> NULL/EINVAL");
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	CHECK(cq != NULL && cq->cqe >= 16, "ibv_create_cq(16)");
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(cq, 1, &wc) == 0, "poll an empty CQ -> 0");
	CHECK(ibv_req_notify_cq(cq, 0) == 0, "ibv_req_notify_cq");
	CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq");
	struct ibv_cq fake_cq;
	memset(&fake_cq, 0, sizeof(fake_cq));
	fake_cq.context = ctx;
	CHECK(ibv_poll_cq(&fake_cq, 1, &wc) < 0, "ops.poll_cq on a foreign CQ fails cleanly");
	CHECK(ibv_req_notify_cq(&fake_cq, 0) == EINVAL, "ops.req_notify_cq on a foreign CQ -> EINVAL");
	struct ibv_qp fake_qp;
	memset(&fake_qp, 0, sizeof(fake_qp));
	fake_qp.context = ctx;
	struct ibv_send_wr swr, *bad_s = NULL;
	memset(&swr, 0, sizeof(swr));
	CHECK(ibv_post_send(&fake_qp, &swr, &bad_s) == EINVAL && bad_s == &swr,
	      "ops.post_send on a foreign QP -> EINVAL, bad_wr = wr");
	struct ibv_recv_wr rwr, *bad_r = NULL;
	memset(&rwr, 0, sizeof(rwr));
	CHECK(ibv_post_recv(&fake_qp, &rwr, &bad_r) == EINVAL && bad_r == &rwr,
	      "ops.post_recv on a foreign QP -> EINVAL");

	/* async event fd: real and pollable, nothing pending */
	struct pollfd pfd = { .fd = ctx->async_fd, .events = POLLIN };
	CHECK(ctx->async_fd >= 0 && poll(&pfd, 1, 0) == 0, "async_fd pollable, no event pending");
	int fl = fcntl(ctx->async_fd, F_GETFL);
	CHECK(fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK) == 0, "async_fd O_NONBLOCK");
	struct ibv_async_event ev;
	errno = 0;
	CHECK(ibv_get_async_event(ctx, &ev) == -1 && errno == EAGAIN,
	      "ibv_get_async_event non-blocking -> -1/EAGAIN");

	/* fork support and string helpers */
	/* libibverbs: UNNEEDED on kernels that copy pinned pages at fork (5.13+), whether or not
	 * ibv_fork_init was called; ENABLED after ibv_fork_init on older kernels. */
	CHECK(ibv_fork_init() == 0, "ibv_fork_init");
	struct utsname uts;
	int kmaj = 0, kmin = 0;
	CHECK(uname(&uts) == 0 && sscanf(uts.release, "%d.%d", &kmaj, &kmin) == 2, "uname");
	enum ibv_fork_status want = kmaj > 5 || (kmaj == 5 && kmin >= 13) ? IBV_FORK_UNNEEDED
									   : IBV_FORK_ENABLED;
	CHECK(ibv_is_fork_initialized() == want, "ibv_is_fork_initialized %d on Linux %d.%d",
	      (int)want, kmaj, kmin);
	CHECK(strcmp(ibv_wc_status_str(IBV_WC_REM_ACCESS_ERR), "remote access error") == 0,
	      "ibv_wc_status_str");
	CHECK(strcmp(ibv_node_type_str(IBV_NODE_CA), "InfiniBand channel adapter") == 0,
	      "ibv_node_type_str");
	CHECK(strcmp(ibv_port_state_str(IBV_PORT_ACTIVE), "active") == 0, "ibv_port_state_str");
	CHECK(strcmp(ibv_event_type_str(IBV_EVENT_PORT_ACTIVE), "port active") == 0,
	      "ibv_event_type_str");

	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
	munmap(buf, len);
	munmap(buf2, len);
}

static void maxmr(int n)
{
	struct ibv_context *ctx = open_mrkit();
	struct ibv_device_attr a;
	CHECK(ibv_query_device(ctx, &a) == 0 && a.max_mr == n, "max_mr reported as %d", n);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL, "alloc_pd");
	long ps = sysconf(_SC_PAGESIZE);
	char *buf = page_buf(ps);
	struct ibv_mr **mrs = calloc(n, sizeof(*mrs));
	for (int i = 0; i < n; i++) {
		mrs[i] = ibv_reg_mr(pd, buf, ps, acc(IBV_ACCESS_LOCAL_WRITE));
		if (!mrs[i])
			CHECK(0, "registration %d of %d", i + 1, n);
	}
	CHECK(1, "%d registrations succeeded", n);
	errno = 0;
	expect_reg_fail(ibv_reg_mr(pd, buf, ps, acc(IBV_ACCESS_LOCAL_WRITE)), ENOMEM,
			"registration beyond MRKIT_MAX_MR");
	CHECK(ibv_dereg_mr(mrs[0]) == 0, "dereg one");
	mrs[0] = ibv_reg_mr(pd, buf, ps, acc(IBV_ACCESS_LOCAL_WRITE));
	CHECK(mrs[0] != NULL, "a slot is free again");
	for (int i = 0; i < n; i++)
		CHECK(ibv_dereg_mr(mrs[i]) == 0, "dereg %d", i);
	CHECK(ibv_dealloc_pd(pd) == 0, "dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "close");
	free(mrs);
}

static void noodp(void)
{
	struct ibv_context *ctx = open_mrkit();
	struct ibv_device_attr_ex ax;
	CHECK(ibv_query_device_ex(ctx, NULL, &ax) == 0 && ax.odp_caps.general_caps == 0,
	      "no ODP caps with MRKIT_ODP=0");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	long ps = sysconf(_SC_PAGESIZE);
	char *buf = page_buf(ps);
	errno = 0;
	expect_reg_fail(ibv_reg_mr(pd, buf, ps, acc(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND)),
			EOPNOTSUPP, "ON_DEMAND without ODP");
	CHECK(ibv_dealloc_pd(pd) == 0, "dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "close");
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	const char *mode = argc > 1 ? argv[1] : "basic";
	if (!strcmp(mode, "basic"))
		basic();
	else if (!strcmp(mode, "maxmr") && argc > 2)
		maxmr(atoi(argv[2]));
	else if (!strcmp(mode, "noodp"))
		noodp();
	else {
		fprintf(stderr, "usage: regrules basic | maxmr N | noodp\n");
		return 2;
	}
	printf("regrules %s: all checks passed\n", mode);
	return failed;
}
