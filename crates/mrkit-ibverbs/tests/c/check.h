/* CHECK(cond, fmt, ...): print "ok   <message>" or "FAIL file:line: <message> (errno ...)"
 * and exit(1). Shared by the C test programs (needs <errno.h>, <stdio.h>, <stdlib.h>,
 * <string.h>). */
#ifndef MRKIT_TEST_CHECK_H
#define MRKIT_TEST_CHECK_H

#define CHECK(cond, ...)                                                                 \
	do {                                                                             \
		if (cond) {                                                              \
			printf("ok   ");                                                 \
			printf(__VA_ARGS__);                                             \
			printf("\n");                                                    \
		} else {                                                                 \
			printf("FAIL %s:%d: ", __FILE__, __LINE__);                      \
			printf(__VA_ARGS__);                                             \
			printf(" (errno %d: %s)\n", errno, strerror(errno));             \
			exit(1);                                                         \
		}                                                                        \
		fflush(stdout);                                                          \
	} while (0)

#endif
