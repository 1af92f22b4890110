/* Loads libmlx5.so.1 and libefa.so.1 (as perftest does, DT_NEEDED + BIND_NOW) on top of mrkit's
 * libibverbs.so.1: every IBVERBS_PRIVATE_34 symbol they import must resolve, their ELF
 * constructors call verbs_register_driver_34(), and their "is this my device?" checks read the
 * word after struct ibv_device (offset 664), which must not look like theirs. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <infiniband/verbs.h>
#include <infiniband/mlx5dv.h>
#include <infiniband/efadv.h>

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n != 1) {
		printf("FAIL device list\n");
		return 1;
	}
	if (mlx5dv_is_supported(list[0])) {
		printf("FAIL mlx5dv_is_supported(mrkit0) is true\n");
		return 1;
	}
	struct ibv_context *ctx = ibv_open_device(list[0]);
	struct efadv_device_attr ea;
	int r = efadv_query_device(ctx, &ea, sizeof(ea));
	if (r == 0) {
		printf("FAIL efadv_query_device(mrkit0) succeeded\n");
		return 1;
	}
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	printf("providers: libmlx5 and libefa loaded; mrkit0 is neither (efadv: %s)\n", strerror(r));
	return 0;
}
