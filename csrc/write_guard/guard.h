/* What the two halves of offloadd.relay._write_guard tell each other.
 *
 * guard.c holds the guarded ranges and the Python module; chain.c holds the SIGSEGV handler and
 * its place among the handlers of other code (Note [chaining] there). The handler asks guard.c
 * about each fault that a protection can raise, and guard.c asks chain.c to be installed.
 */
#ifndef OFFLOADD_WRITE_GUARD_H
#define OFFLOADD_WRITE_GUARD_H

#include <stdint.h>

/* Whether a SEGV_ACCERR fault at ``at`` is the guard's to settle: a write into a guarded range
 * (recorded, the range made writable), or an access to be retried because a release made its
 * range writable meanwhile (Note [a fault racing a release] in guard.c). Nonzero: return from
 * the handler and let the access run again. Async-signal-safe. */
__attribute__((visibility("hidden"))) int guard_settles(uintptr_t at);

/* Put the guard's handler on top of SIGSEGV unless it is there (the caller serialises calls):
 * 0, -1 with errno set when sigaction failed, -2 when other handlers have been put over it too
 * many times to chain to one more. */
__attribute__((visibility("hidden"))) int chain_install(void);

#endif
