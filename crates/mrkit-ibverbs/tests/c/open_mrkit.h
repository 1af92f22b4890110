/* open_mrkit(): open the one device the drop-in library lists (mrkit0), CHECKing each step.
 * Shared by the C test programs that use verbs (include after <infiniband/verbs.h> and
 * "check.h"). */
#ifndef MRKIT_TEST_OPEN_MRKIT_H
#define MRKIT_TEST_OPEN_MRKIT_H

static struct ibv_context *open_mrkit(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1, "ibv_get_device_list: %d device(s)", n);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx != NULL, "ibv_open_device");
	ibv_free_device_list(list);
	return ctx;
}

#endif
