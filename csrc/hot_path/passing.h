/* relay's pass-through pair (passing.c), added to offloadd.runtime._held by its module init,
 * and what it shares of held.c. */
#ifndef OFFLOADD_PASSING_H
#define OFFLOADD_PASSING_H

#include <Python.h>

/* Adds PassPack and PassUnpack to the module m; -1 with an exception set on failure. */
int passing_add(PyObject *m);

/* held.c's: 1 if ``name`` of ``obj`` is set and true, 0 if not (or missing), -1 on error. */
int held_attr_true(PyObject *obj, PyObject *name);

#endif
