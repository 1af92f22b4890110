/* mrkit_ext.h: mrkit extensions of the drop-in libibverbs.so.1 (link with -libverbs).
 *
 * mrkit_query_mr() reports what the device knows about a registered MR: keys, range,
 * access, page size, pinned bytes, age and how long its registration took. rdma-core has no
 * ibv_query_mr(); for code written against that name (struct ibv_mr_info, fields lkey, rkey,
 * length, ...) this header maps it to mrkit_query_mr unless MRKIT_NO_IBV_QUERY_MR is defined.
 *
 * Returns 0, or an errno value (EINVAL: mr or attr is NULL, or mr is not a live MR of this
 * library; ENODEV: its context was closed). The symbol is versioned MRKIT_1.0.
 */
#ifndef MRKIT_EXT_H
#define MRKIT_EXT_H

#include <stdint.h>
#include <infiniband/verbs.h>

#ifdef __cplusplus
extern "C" {
#endif

enum mrkit_mr_kind {
	MRKIT_MR_PINNED = 0,       /* pages pinned at registration */
	MRKIT_MR_ODP = 1,          /* on-demand paging over a range */
	MRKIT_MR_IMPLICIT_ODP = 2, /* the whole address space */
};

struct mrkit_mr_attr {
	uint64_t addr;           /* registered virtual address */
	uint64_t length;         /* bytes */
	uint64_t iova;           /* first address of the MR's address space */
	uint32_t lkey;
	uint32_t rkey;
	uint32_t access;         /* enum ibv_access_flags */
	uint32_t pd_handle;
	uint64_t page_size;      /* largest page size backing the MR */
	uint64_t page_count;     /* translation entries */
	uint64_t pinned_bytes;   /* 0 for on-demand MRs */
	uint32_t kind;           /* enum mrkit_mr_kind */
	uint32_t bound_mws;      /* memory windows bound now */
	uint64_t age_ns;         /* time since registration */
	/* Registration time and its phases, measured by the device (0 if unknown). */
	uint64_t reg_total_ns;
	uint64_t reg_accounting_ns;  /* checks and RLIMIT_MEMLOCK accounting */
	uint64_t reg_pin_ns;         /* pinning the pages */
	uint64_t reg_walk_ns;        /* page walk */
	uint64_t reg_translation_ns; /* DONTFORK and translation entries */
	uint64_t reg_key_ns;         /* key and publication */
	uint64_t reserved[4];
};

int mrkit_query_mr(struct ibv_mr *mr, struct mrkit_mr_attr *attr);

#ifndef MRKIT_NO_IBV_QUERY_MR
#define ibv_mr_info mrkit_mr_attr
#define ibv_query_mr mrkit_query_mr
#endif

#ifdef __cplusplus
}
#endif

#endif /* MRKIT_EXT_H */
