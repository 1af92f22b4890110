/* The seeds' monitor_mr() compiled against mrkit with one include (mrkit_ext.h), then
 * mrkit_query_mr's own fields and errors. argv[1]: how many extra registrations to make
 * (the probe test traces them). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>
#include <mrkit/mrkit_ext.h>

#include "check.h"
#include "open_mrkit.h"

#define LOG(...) (printf(__VA_ARGS__), printf("\n"))

/* As the seeds write it. */
static void monitor_mr(struct ibv_mr *mr)
{
	struct ibv_mr_info info;
	if (ibv_query_mr(mr, &info) == 0) {
		LOG("MR %p: lkey=0x%x rkey=0x%x size=%zu", (void *)mr, info.lkey, info.rkey, info.length);
	}
}

int main(int argc, char **argv)
{
	int extra = argc > 1 ? atoi(argv[1]) : 0;
	struct ibv_context *ctx = open_mrkit();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd, "ibv_alloc_pd");
	size_t len = 64 * 1024;
	char *buf = aligned_alloc(4096, len);
	CHECK(buf, "alloc");
	memset(buf, 1, len);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	CHECK(mr, "ibv_reg_mr");
	monitor_mr(mr);

	struct mrkit_mr_attr a;
	memset(&a, 0xff, sizeof a);
	CHECK(mrkit_query_mr(mr, &a) == 0, "mrkit_query_mr");
	CHECK(a.lkey == mr->lkey && a.rkey == mr->rkey, "keys");
	CHECK(a.addr == (uint64_t)(uintptr_t)buf && a.length == len && a.iova == a.addr, "range");
	CHECK(a.access == (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ), "access %#x", a.access);
	CHECK(a.kind == MRKIT_MR_PINNED && a.pinned_bytes == len && a.page_size >= 4096, "pinning");
	CHECK(a.reg_total_ns > 0 && a.reg_pin_ns > 0 && a.reg_total_ns >= a.reg_pin_ns, "timing");
	CHECK(a.reserved[0] == 0 && a.reserved[3] == 0, "reserved");
	LOG("timing total=%llu pin=%llu walk=%llu", (unsigned long long)a.reg_total_ns,
	    (unsigned long long)a.reg_pin_ns, (unsigned long long)a.reg_walk_ns);

	/* Hostile arguments: errors, never a crash. */
	CHECK(mrkit_query_mr(NULL, &a) == EINVAL && errno == EINVAL, "NULL mr");
	CHECK(mrkit_query_mr(mr, NULL) == EINVAL, "NULL attr");
	struct ibv_mr fake = *mr;
	CHECK(mrkit_query_mr(&fake, &a) == EINVAL, "not an MR of the library");

	for (int i = 0; i < extra; i++) {
		struct ibv_mr *m = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
		CHECK(m, "ibv_reg_mr %d", i);
		CHECK(ibv_dereg_mr(m) == 0, "ibv_dereg_mr");
	}

	CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
	CHECK(mrkit_query_mr(mr, &a) == EINVAL, "a deregistered MR");
	CHECK(ibv_dealloc_pd(pd) == 0, "dealloc");
	CHECK(ibv_close_device(ctx) == 0, "close");
	free(buf);
	printf("OK\n");
	return 0;
}
