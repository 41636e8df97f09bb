/* The init of scripts/seccomp_vm_check.py's virtual machine: it asks a real kernel for its verdicts.

   Reads /cases (one call per line: number and six arguments) and, for each filter named on
   /filters (one file name per line, "none" for no filter), runs every call in a child process of
   its own that loads that filter first (no_new_privs, then PR_SET_SECCOMP) and makes the call
   directly. Prints one line per call, "R <filter> <index> <ret> <errno>" or "R <filter> <index>
   killed <signal>" (after "UNAME <release> <machine>"), then "DONE" and powers the machine off. A clone that made a child: the child
   leaves at once. */
#define _GNU_SOURCE
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_CASES 512

static long cases[MAX_CASES][7];

static int load(const char *name, struct sock_fprog *prog) {
    static unsigned char buf[65536];
    FILE *f = fopen(name, "rb");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    prog->len = (unsigned short)(n / sizeof(struct sock_filter));
    prog->filter = (struct sock_filter *)buf;
    return 0;
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    FILE *f = fopen("/cases", "r");
    int n = 0;
    while (f && n < MAX_CASES && fscanf(f, "%ld %ld %ld %ld %ld %ld %ld", &cases[n][0], &cases[n][1],
                                         &cases[n][2], &cases[n][3], &cases[n][4], &cases[n][5],
                                         &cases[n][6]) == 7)
        n++;
    struct utsname u;
    if (uname(&u) == 0) printf("UNAME %s %s\n", u.release, u.machine);
    printf("CASES %d\n", n);
    FILE *names = fopen("/filters", "r");
    char name[256];
    while (names && fscanf(names, "%255s", name) == 1) {
        struct sock_fprog prog;
        int filtered = strcmp(name, "none") != 0;
        if (filtered && load(name, &prog) != 0) {
            printf("MISSING %s\n", name);
            continue;
        }
        for (int i = 0; i < n; i++) {
            int fds[2];
            if (pipe(fds) != 0) return 1;
            pid_t pid = fork();
            if (pid == 0) {
                close(fds[0]);
                if (filtered && (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
                                 prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0))
                    _exit(100);
                long *c = cases[i];
                long ret = syscall(c[0], c[1], c[2], c[3], c[4], c[5], c[6]);
                long result[2] = {ret, ret == -1 ? errno : 0};
                if (ret == 0 && c[0] == SYS_clone) _exit(0);  /* the clone's child */
                if (write(fds[1], result, sizeof result) != sizeof result) _exit(101);
                _exit(0);
            }
            close(fds[1]);
            long result[2];
            ssize_t got = read(fds[0], result, sizeof result);
            close(fds[0]);
            int status = 0;
            waitpid(pid, &status, 0);
            if (got == (ssize_t)sizeof result)
                printf("R %s %d %ld %ld\n", name, i, result[0], result[1]);
            else if (WIFSIGNALED(status))
                printf("R %s %d killed %d\n", name, i, WTERMSIG(status));
            else
                printf("R %s %d exit %d\n", name, i, WEXITSTATUS(status));
        }
    }
    printf("DONE\n");
    sync();
    reboot(RB_POWER_OFF);
    return 0;
}
