/* relay's pass-through pair (passing.c), added to offloadd.runtime._held by its module init. */
#ifndef OFFLOADD_PASSING_H
#define OFFLOADD_PASSING_H

#include <Python.h>

/* Adds PassPack and PassUnpack to the module m; -1 with an exception set on failure. */
int passing_add(PyObject *m);

#endif
