/* A forked child is a new process: when it opens mrkit0 it exports its own statistics file.
 * Prints "parent PID child PID", then both stay alive for argv[1] milliseconds. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#include "check.h"
#include "open_mrkit.h"

int main(int argc, char **argv)
{
	int ms = argc > 1 ? atoi(argv[1]) : 2000;
	struct timespec t = { ms / 1000, (ms % 1000) * 1000000L };
	struct ibv_context *ctx = open_mrkit();
	fflush(stdout);
	pid_t child = fork();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		struct ibv_context *c = open_mrkit();
		nanosleep(&t, NULL);
		ibv_close_device(c);
		_exit(0);
	}
	printf("parent %d child %d\n", (int)getpid(), (int)child);
	fflush(stdout);
	nanosleep(&t, NULL);
	int st = 0;
	CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child");
	ibv_close_device(ctx);
	return 0;
}
