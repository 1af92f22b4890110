/*
 * A test-only libibverbs.so.1 in front of another one (the project's drop-in): every verb is
 * forwarded to the library MRKIT_SHIM_TARGET names, with one change chosen by MRKIT_SHIM_MODE:
 *
 *   legacy  the contexts it opens are not extended (abi_compat is not all ones): the inline
 *           verbs of <infiniband/verbs.h> then find no extended op (query_port,
 *           query_device_ex, advise_mr, ...) and take their old paths, as with a library or
 *           provider that predates them (ibv_query_port falls back to the exported compat
 *           symbol, ibv_query_device_ex to ibv_query_device with the extension zeroed).
 *   values  the device reports attributes other than mrkit0's: every attribute of
 *           ibv_query_device that mrkit0 leaves 0 (EE, RDD, raw QPs, multicast, FMR, ...),
 *           a different max_ah, and a full ibv_query_device_ex extension (ODP per transport,
 *           timestamps, clock, TSO/RSS, packet pacing, tag matching, CQ moderation, DM,
 *           PCI atomics), and 3 completion vectors.
 *
 * Built by mrkit-testsupport's ibverbs_shim module with the system's rdma-core headers.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

static void *target(void)
{
	static void *h;
	if (!h) {
		const char *p = getenv("MRKIT_SHIM_TARGET");
		h = p ? dlopen(p, RTLD_NOW | RTLD_LOCAL) : NULL;
		if (!h) {
			fprintf(stderr, "ibverbs shim: cannot load MRKIT_SHIM_TARGET %s: %s\n",
				p ? p : "(unset)", dlerror());
			abort();
		}
	}
	return h;
}

static void *sym(const char *name)
{
	void *f = dlsym(target(), name);
	if (!f) {
		fprintf(stderr, "ibverbs shim: the target has no %s\n", name);
		abort();
	}
	return f;
}

static int mode_is(const char *m)
{
	const char *v = getenv("MRKIT_SHIM_MODE");
	return v && strcmp(v, m) == 0;
}

#define FWD(ret, name, params, args)                          \
	ret name params                                       \
	{                                                     \
		static ret(*fwd_) params;                     \
		if (!fwd_)                                    \
			fwd_ = (ret(*) params)sym(#name);     \
		return fwd_ args;                                \
	}

#define FWDV(name, params, args)                              \
	void name params                                      \
	{                                                     \
		static void(*fwd_) params;                    \
		if (!fwd_)                                    \
			fwd_ = (void(*) params)sym(#name);    \
		fwd_ args;                                       \
	}

FWD(struct ibv_device **, ibv_get_device_list, (int *n), (n))
FWDV(ibv_free_device_list, (struct ibv_device **l), (l))
FWD(const char *, ibv_get_device_name, (struct ibv_device *d), (d))
FWD(__be64, ibv_get_device_guid, (struct ibv_device *d), (d))
FWD(int, ibv_query_gid, (struct ibv_context *c, uint8_t p, int i, union ibv_gid *g), (c, p, i, g))
FWD(int, ibv_query_gid_type, (struct ibv_context *c, uint8_t p, unsigned int i, int *t), (c, p, i, t))
FWD(int, ibv_read_sysfs_file, (const char *d, const char *f, char *b, size_t s), (d, f, b, s))
FWD(struct ibv_pd *, ibv_alloc_pd, (struct ibv_context *c), (c))
FWD(int, ibv_dealloc_pd, (struct ibv_pd *p), (p))
FWD(struct ibv_mr *, ibv_reg_mr_iova2, (struct ibv_pd *p, void *a, size_t l, uint64_t i, unsigned int f), (p, a, l, i, f))
FWD(int, ibv_dereg_mr, (struct ibv_mr *m), (m))
FWD(int, ibv_rereg_mr, (struct ibv_mr *m, int f, struct ibv_pd *p, void *a, size_t l, int acc), (m, f, p, a, l, acc))
FWD(struct ibv_comp_channel *, ibv_create_comp_channel, (struct ibv_context *c), (c))
FWD(int, ibv_destroy_comp_channel, (struct ibv_comp_channel *c), (c))
FWD(struct ibv_cq *, ibv_create_cq, (struct ibv_context *c, int n, void *x, struct ibv_comp_channel *ch, int v), (c, n, x, ch, v))
FWD(int, ibv_destroy_cq, (struct ibv_cq *c), (c))
FWD(int, ibv_get_cq_event, (struct ibv_comp_channel *ch, struct ibv_cq **c, void **x), (ch, c, x))
FWDV(ibv_ack_cq_events, (struct ibv_cq *c, unsigned int n), (c, n))
FWD(struct ibv_qp *, ibv_create_qp, (struct ibv_pd *p, struct ibv_qp_init_attr *a), (p, a))
FWD(int, ibv_modify_qp, (struct ibv_qp *q, struct ibv_qp_attr *a, int m), (q, a, m))
FWD(int, ibv_query_qp, (struct ibv_qp *q, struct ibv_qp_attr *a, int m, struct ibv_qp_init_attr *i), (q, a, m, i))
FWD(int, ibv_destroy_qp, (struct ibv_qp *q), (q))

/* The compat entry (48-byte struct), which the headers' inline ibv_query_port falls back to. */
#undef ibv_query_port
FWD(int, ibv_query_port, (struct ibv_context *c, uint8_t p, struct _compat_ibv_port_attr *a), (c, p, a))

static void other_values(struct ibv_device_attr *a)
{
	a->max_ee_rd_atom = 1;
	a->max_ee_init_rd_atom = 2;
	a->max_ee = 3;
	a->max_rdd = 4;
	a->max_raw_ipv6_qp = 5;
	a->max_raw_ethy_qp = 6;
	a->max_mcast_grp = 7;
	a->max_mcast_qp_attach = 8;
	a->max_total_mcast_qp_attach = 9;
	a->max_ah = 12345;
	a->max_fmr = 10;
	a->max_map_per_fmr = 11;
}

int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *a)
{
	static int (*f)(struct ibv_context *, struct ibv_device_attr *);
	if (!f)
		f = (int (*)(struct ibv_context *, struct ibv_device_attr *))sym("ibv_query_device");
	int r = f(c, a);
	if (r == 0 && mode_is("values"))
		other_values(a);
	return r;
}

/* The target's query_device_ex op of each context is the same function (one library). */
static int (*orig_qdex)(struct ibv_context *, const struct ibv_query_device_ex_input *,
			struct ibv_device_attr_ex *, size_t);

static int shim_qdex(struct ibv_context *c, const struct ibv_query_device_ex_input *in,
		     struct ibv_device_attr_ex *a, size_t size)
{
	struct ibv_device_attr_ex x;
	memset(&x, 0, sizeof x);
	int r = orig_qdex(c, in, &x, sizeof x);
	if (r)
		return r;
	other_values(&x.orig_attr);
	x.odp_caps.per_transport_caps.uc_odp_caps = IBV_ODP_SUPPORT_SEND;
	x.odp_caps.per_transport_caps.ud_odp_caps = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV;
	x.xrc_odp_caps = IBV_ODP_SUPPORT_READ | (1u << 9);
	x.completion_timestamp_mask = 0x7fffffffffffffffull;
	x.hca_core_clock = 156250;
	x.raw_packet_caps = IBV_RAW_PACKET_CAP_CVLAN_STRIPPING | IBV_RAW_PACKET_CAP_IP_CSUM;
	x.device_cap_flags_ex |= IBV_DEVICE_RAW_SCATTER_FCS | (1ull << 40);
	x.tso_caps.max_tso = 262144;
	x.tso_caps.supported_qpts = 1u << IBV_QPT_RAW_PACKET;
	x.rss_caps.supported_qpts = (1u << IBV_QPT_RAW_PACKET) | (1u << IBV_QPT_UD) | (1u << 2);
	x.rss_caps.max_rwq_indirection_tables = 64;
	x.rss_caps.max_rwq_indirection_table_size = 2048;
	x.rss_caps.rx_hash_fields_mask = 0x3ff;
	x.rss_caps.rx_hash_function = 1;
	x.max_wq_type_rq = 4096;
	x.packet_pacing_caps.qp_rate_limit_min = 1;
	x.packet_pacing_caps.qp_rate_limit_max = 100000000;
	x.packet_pacing_caps.supported_qpts = 1u << IBV_QPT_RAW_PACKET;
	x.tm_caps.max_rndv_hdr_size = 64;
	x.tm_caps.max_num_tags = 63;
	x.tm_caps.flags = IBV_TM_CAP_RC;
	x.tm_caps.max_ops = 32768;
	x.tm_caps.max_sge = 1;
	x.cq_mod_caps.max_cq_count = 65535;
	x.cq_mod_caps.max_cq_period = 4095;
	x.max_dm_size = 131072;
	x.pci_atomic_caps.fetch_add = 0x1c;
	x.pci_atomic_caps.swap = 0x1c;
	x.pci_atomic_caps.compare_swap = 0x1c;
	memcpy(a, &x, size < sizeof x ? size : sizeof x);
	return 0;
}

static void *saved_abi_compat;

struct ibv_context *ibv_open_device(struct ibv_device *d)
{
	static struct ibv_context *(*f)(struct ibv_device *);
	if (!f)
		f = (struct ibv_context * (*)(struct ibv_device *)) sym("ibv_open_device");
	struct ibv_context *c = f(d);
	if (!c)
		return c;
	if (mode_is("legacy")) {
		saved_abi_compat = c->abi_compat;
		c->abi_compat = NULL;
	} else if (mode_is("values")) {
		struct verbs_context *v = verbs_get_ctx(c);
		if (v && v->query_device_ex) {
			orig_qdex = v->query_device_ex;
			v->query_device_ex = shim_qdex;
		}
		c->num_comp_vectors = 3;
	}
	return c;
}

int ibv_close_device(struct ibv_context *c)
{
	static int (*f)(struct ibv_context *);
	if (!f)
		f = (int (*)(struct ibv_context *))sym("ibv_close_device");
	/* Hand the target its context as it made it. */
	if (mode_is("legacy")) {
		c->abi_compat = saved_abi_compat;
	} else if (mode_is("values")) {
		struct verbs_context *v = verbs_get_ctx(c);
		if (v && v->query_device_ex == shim_qdex)
			v->query_device_ex = orig_qdex;
		c->num_comp_vectors = 1;
	}
	return f(c);
}
