/* The write guard's SIGSEGV handler, and its place among the handlers of other code.
 *
 * Note [chaining]
 * ~~~~~~~~~~~~~~~
 * Other code in the process may take SIGSEGV as a normal event: a JVM (through JPype), Julia,
 * wasmtime, .NET, a Go c-shared library, each fault on pages of their own and recover in their
 * handler. So the guard's handler never uninstalls itself. What it does not settle (guard.c:
 * guard_settles) goes to the handler it displaced, as the kernel would have delivered it:
 *
 * - a function: called with the same signal, siginfo and context (so it may change the context
 *   it returns to, or siglongjmp out), with its sa_mask blocked and, for SA_NODEFER, the signal
 *   unblocked, as on a delivery; SA_RESETHAND: called once, the default action from then on.
 *   It runs on the stack the guard's handler runs on (the thread's alternate one if it has one);
 * - SIG_DFL: for a fault, the default action is put back and the handler returns, so the access
 *   faults again and kills with its own siginfo (a core dump shows the real fault); a signal
 *   sent by kill or raise is raised again, delivered as soon as the handler returns;
 * - SIG_IGN: a sent signal is ignored; a fault cannot be (the kernel kills on an ignored fault
 *   too), so it takes the default action.
 *
 * A handler installed after the guard's sees every SIGSEGV first. One that chains (calls the
 * handler it displaced, or puts it back and lets the fault recur) hands guarded writes on to the
 * guard; one that does not takes them for its own faults until the next protect() puts the
 * guard's handler back on top (chain_install). That second install must not make a cycle: the
 * other handler keeps the guard's as the one it displaced, and a fault nobody claims would go
 * round (the guard, it, the guard ...) forever. So each install is a level with an entry point
 * of its own: level k passes on to the handler it displaced, displaced[k], and when that handler
 * chains it reaches the entry point it displaced, level k - 1, which passes on further down. A
 * handler that the guard displaced before (faulthandler enabled again) gets its level back.
 * After LEVELS installs protect() fails: relay leaves that slab unguarded and says so. (A
 * handler that puts itself over the guard's once more, now keeping the guard's newer entry as
 * the one it displaced, still closes a cycle: a fault nobody claims then recurses until the
 * stack overflows, and the kernel ends the process with SIGSEGV all the same.)
 *
 * The handler reads displaced[k] only once entry k is installed, and displaced[k] is written
 * once, before; the SA_RESETHAND marks are atomics. The handler calls only async-signal-safe
 * functions (mprotect, sigaction, pthread_sigmask, raise).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "guard.h"

#define LEVELS 8

typedef void (*Entry)(int, siginfo_t *, void *);

static struct sigaction displaced[LEVELS];
static int masks[LEVELS];        /* calling displaced[k] changes the signal mask */
static atomic_int spent[LEVELS]; /* displaced[k] was SA_RESETHAND and has run: SIG_DFL now */
static int levels;               /* entries installed so far; chain_install's callers serialise */

static void act_by_default(int sig, int sent) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (sent) /* blocked in this handler: delivered when it returns */
        raise(sig);
}

static void call(int level, int sig, siginfo_t *info, void *context) {
    const struct sigaction *to = &displaced[level];
    sigset_t was, unblock;
    if (masks[level]) {
        pthread_sigmask(SIG_BLOCK, &to->sa_mask, &was);
        if (to->sa_flags & SA_NODEFER) {
            sigemptyset(&unblock);
            sigaddset(&unblock, sig);
            pthread_sigmask(SIG_UNBLOCK, &unblock, NULL);
        }
    }
    if (to->sa_flags & SA_SIGINFO)
        to->sa_sigaction(sig, info, context);
    else
        to->sa_handler(sig);
    if (masks[level])
        pthread_sigmask(SIG_SETMASK, &was, NULL);
}

static void pass_on(int level, int sig, siginfo_t *info, void *context) {
    const struct sigaction *to = &displaced[level];
    int sent = info->si_code <= 0; /* kill, raise, sigqueue: not a fault */
    if (atomic_load(&spent[level]) || to->sa_handler == SIG_DFL) {
        act_by_default(sig, sent);
    } else if (to->sa_handler == SIG_IGN) {
        if (!sent)
            act_by_default(sig, sent);
    } else {
        if (to->sa_flags & SA_RESETHAND)
            atomic_store(&spent[level], 1);
        call(level, sig, info, context);
    }
}

static void on_segv(int level, int sig, siginfo_t *info, void *context) {
    int saved = errno;
    if (info->si_code != SEGV_ACCERR || !guard_settles((uintptr_t)info->si_addr))
        pass_on(level, sig, info, context);
    errno = saved;
}

#define ENTRY(k)                                                                                   \
    static void on_segv_##k(int sig, siginfo_t *info, void *context) {                            \
        on_segv(k, sig, info, context);                                                            \
    }
ENTRY(0)
ENTRY(1)
ENTRY(2)
ENTRY(3)
ENTRY(4)
ENTRY(5)
ENTRY(6)
ENTRY(7)

static const Entry entries[LEVELS] = {
    on_segv_0, on_segv_1, on_segv_2, on_segv_3, on_segv_4, on_segv_5, on_segv_6, on_segv_7,
};

static int same(const struct sigaction *a, const struct sigaction *b) {
    return a->sa_handler == b->sa_handler && a->sa_flags == b->sa_flags;
}

int chain_install(void) {
    struct sigaction now;
    if (sigaction(SIGSEGV, NULL, &now) != 0)
        return -1;
    int level = levels;
    for (int k = 0; k < levels; k++) {
        if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == entries[k])
            return 0; /* one of ours is on top */
        if (same(&now, &displaced[k]))
            level = k;
    }
    if (level == levels) {
        if (levels == LEVELS)
            return -2;
        displaced[level] = now;
        masks[level] = (now.sa_flags & SA_NODEFER) || !sigisemptyset(&now.sa_mask);
        levels++;
    }
    atomic_store(&spent[level], 0);
    struct sigaction mine;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = entries[level];
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&mine.sa_mask);
    return sigaction(SIGSEGV, &mine, NULL);
}
