/* offloadd.runtime._held: what pack returns for a saved tensor that stays where it is, and the
 * tally of those tensors' bytes.
 *
 * Most saved tensors are small: offloadd keeps them, and for each it must remember the version
 * counter (to raise PyTorch's in-place error at unpack) and count its bytes while autograd holds
 * it (the peak of saved activation memory). In Python that was an object with __slots__ and a
 * __del__ queueing its release, applied later under the lock, a cost of the same order as a
 * no-op hook pair's (offloadd bench hooks; the figures are in
 * docs/benchmarks/hooks_cpu-2core_2026-12-05.md). Here a Held is made and freed in C and
 * its bytes are added and taken off a Tally at once, under the GIL; the lock-holding paths read
 * the tally with Tally.take() (offloadd/runtime/held.py has the same in Python, used where this
 * library is not built, and says how the ledger applies it).
 *
 * Tally.keep(tensor, nbytes, resident) -> Held:
 *   counts one saved tensor of nbytes, of which resident bytes are held for it (0 for a
 *   parameter: the model holds it anyway); the Held holds the tensor (detached if it requires
 *   grad: see [no cycle through the graph] in identity.py) and its version at pack.
 * Tally.share(tensor, nbytes) -> Held:
 *   the same for a tensor whose storage counts once however many saved tensors hold it (tier
 *   keep: its storage's bytes are held from its first save until its last Held goes; a later
 *   save of that storage counts its nbytes as deduplicated). The storages held are keyed by
 *   their StorageImpl's address, pinned by a weak reference while they are held (see Shared).
 * Tally.take() -> (saved, saved_bytes, deduplicated_bytes, now, peak):
 *   the tensors and bytes counted since the last take (and of those bytes, the ones shared with
 *   an earlier save), the resident bytes held now, and the highest ``now`` since the last take;
 *   the next interval's peak starts from ``now``.
 *
 * Pack(tally, min_bytes, index, captures, evicted, slow, tensor_type, parameter_type, strided,
 *      is_parameter) and Unpack(slow): the saved-tensor hooks themselves, for the common case
 *   only. Pack keeps a strided parameter, or a plain strided tensor below min_bytes (or of no
 *   bytes), as a Held, where no capture is pending (captures.num_pending) and no compiled graph
 *   left a claim on this thread (evicted.claims); anything else goes to slow(t), offloadd's pack
 *   in Python. Unpack returns a
 *   Held's tensor when its version is unchanged, else slow(packed). Without a Python frame there
 *   is nothing for dynamo to trace (see [invisible to dynamo] in compiled.py); slow is already
 *   hidden from it. Both have a __dict__ (the marks offloadd puts on its pack hook).
 *   Given ``index`` (tier keep: offloadd's StorageIndex, else None), Pack also keeps a plain
 *   tensor of min_bytes or more: as a parameter where the index knows its storage, else
 *   through Tally.share (see known_parameter); one the index may not know yet goes to slow(t).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "passing.h"

#if PY_VERSION_HEX >= 0x030D0000
#define LOOKUP_ATTR PyObject_GetOptionalAttr
#define IS_FINALIZING Py_IsFinalizing
#else
#define LOOKUP_ATTR _PyObject_LookupAttr /* the same, before 3.13 */
#define IS_FINALIZING _Py_IsFinalizing
#endif

typedef struct {
    PyObject_HEAD
    long long saved;
    long long saved_bytes;
    long long deduplicated_bytes;
    long long now;
    long long peak;
    PyObject *shared; /* {StorageImpl address: Shared} of the storages held through share */
} Tally;

/* One storage held through Tally.share, and how many Helds hold it. ``weak``: a weak reference
 * to its StorageImpl (torch's ``_weak_ref()``), which pins the address ``key`` while the entry
 * lives: a Held's tensor may move to other bytes (``x.data = y``) and free this storage, whose
 * address a new one could otherwise take and be counted as this one. */
typedef struct {
    PyObject_HEAD
    PyObject *key;
    PyObject *weak;
    long long nbytes;
    long long count;
} Shared;

static PyObject *free_weak_ref; /* torch's UntypedStorage._free_weak_ref, found at first use */

typedef struct {
    PyObject_HEAD
    PyObject *tensor;
    PyObject *version;
    long long nbytes;
    Tally *tally;
    Shared *shared;
} Held;

static PyTypeObject TallyType;
static PyTypeObject HeldType;
static PyTypeObject SharedType;
static PyObject *s_requires_grad, *s_detach, *s_version, *s_num_pending, *s_claims, *s_layout,
    *s_is_meta, *s_nbytes, *s_base, *s_untyped_storage, *s_cdata, *s_expired, *s_learned, *s_step, *s_params, *s_weak_ref;

static void shared_dealloc(Shared *self) {
    if (self->weak != NULL && free_weak_ref != NULL && !IS_FINALIZING()) {
        PyObject *type, *value, *tb; /* a dealloc may run while an exception is set */
        PyErr_Fetch(&type, &value, &tb);
        PyObject *r = PyObject_CallOneArg(free_weak_ref, self->weak);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(self->weak);
    Py_XDECREF(self->key);
    PyObject_Free(self);
}

static PyTypeObject SharedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.runtime._held.Shared",
    .tp_basicsize = sizeof(Shared),
    .tp_dealloc = (destructor)shared_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A storage held through Tally.share.",
};

/* The last Held of a shared storage is gone: its bytes are no longer held. */
/* The entry leaves the tally's dict, if it is still the one there. */
static void forget_shared(Tally *tally, Shared *shared) {
    PyObject *type, *value, *tb; /* a dealloc may run while an exception is set */
    PyErr_Fetch(&type, &value, &tb);
    if (tally->shared != NULL) {
        PyObject *now = PyDict_GetItemWithError(tally->shared, shared->key); /* borrowed */
        if (now == (PyObject *)shared && PyDict_DelItem(tally->shared, shared->key) < 0)
            PyErr_Clear();
        if (now == NULL)
            PyErr_Clear();
    }
    PyErr_Restore(type, value, tb);
}

static void release_shared(Tally *tally, Shared *shared) {
    if (--shared->count > 0)
        return;
    tally->now -= shared->nbytes;
    forget_shared(tally, shared);
}

static void held_dealloc(Held *self) {
    if (self->tally != NULL) {
        self->tally->now -= self->nbytes;
        if (self->shared != NULL) {
            release_shared(self->tally, self->shared);
            Py_DECREF(self->shared);
        }
        Py_DECREF(self->tally);
    }
    Py_XDECREF(self->tensor);
    Py_XDECREF(self->version);
    PyObject_Free(self);
}

static PyMemberDef held_members[] = {
    {"tensor", T_OBJECT_EX, offsetof(Held, tensor), READONLY, "the saved tensor"},
    {"version", T_OBJECT_EX, offsetof(Held, version), READONLY, "its version counter at pack"},
    {"nbytes", T_LONGLONG, offsetof(Held, nbytes), READONLY, "its bytes held for it"},
    {NULL},
};

static PyTypeObject HeldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.runtime._held.Held",
    .tp_basicsize = sizeof(Held),
    .tp_dealloc = (destructor)held_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A saved tensor kept as it is (made by Tally.keep).",
    .tp_members = held_members,
};

/* 1 if ``name`` of ``obj`` is set and true, 0 if not (or missing), -1 on error (passing.c's
 * too: declared in passing.h). */
int held_attr_true(PyObject *obj, PyObject *name) {
    PyObject *v;
    if (LOOKUP_ATTR(obj, name, &v) < 0)
        return -1;
    if (v == NULL)
        return 0;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* ``unlink``: detach a tensor that requires grad (an op's output saved by that op would make a
 * cycle through the graph): UNLINK_ASK reads ``requires_grad``, UNLINK_NO (a parameter, a leaf,
 * which makes none) and UNLINK_YES (known to require grad) do not. */
enum { UNLINK_NO = 0, UNLINK_YES = 1, UNLINK_ASK = 2 };

static PyObject *keep(Tally *self, PyObject *t, long long nbytes, long long resident, int unlink) {
    int requires = unlink == UNLINK_ASK ? held_attr_true(t, s_requires_grad) : unlink;
    if (requires < 0)
        return NULL;
    PyObject *version = PyObject_GetAttr(t, s_version);
    if (version == NULL)
        return NULL;
    PyObject *held_tensor;
    if (requires) {
        held_tensor = PyObject_CallMethodNoArgs(t, s_detach);
        if (held_tensor == NULL) {
            Py_DECREF(version);
            return NULL;
        }
    } else {
        held_tensor = Py_NewRef(t);
    }
    Held *h = PyObject_New(Held, &HeldType);
    if (h == NULL) {
        Py_DECREF(version);
        Py_DECREF(held_tensor);
        return NULL;
    }
    h->tensor = held_tensor;
    h->version = version;
    h->nbytes = resident;
    h->tally = (Tally *)Py_NewRef(self);
    h->shared = NULL;
    self->saved += 1;
    self->saved_bytes += nbytes;
    self->now += resident;
    if (self->now > self->peak)
        self->peak = self->now;
    return (PyObject *)h;
}

/* 0 and the error cleared if it is an Exception (the tensor has no storage of its own: a zero
 * tensor, a functional wrapper), else -1 (KeyboardInterrupt, MemoryError go on up). */
static int no_storage(void) {
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* t's storage (a new reference), its key (its StorageImpl's address) and bytes: 1, or 0 with no
 * exception set if it has none, or -1 on error. */
static int storage_of(PyObject *t, PyObject **storage, PyObject **key, long long *nbytes) {
    *storage = PyObject_CallMethodNoArgs(t, s_untyped_storage);
    if (*storage == NULL)
        return no_storage();
    *key = PyObject_GetAttr(*storage, s_cdata);
    PyObject *sn = *key == NULL ? NULL : PyObject_CallMethodNoArgs(*storage, s_nbytes);
    if (sn == NULL) {
        Py_CLEAR(*key);
        Py_CLEAR(*storage);
        return no_storage();
    }
    *nbytes = PyLong_AsLongLong(sn);
    Py_DECREF(sn);
    if (*nbytes == -1 && PyErr_Occurred()) {
        Py_CLEAR(*key);
        Py_CLEAR(*storage);
        return -1;
    }
    return 1;
}

/* keep() for a tensor whose storage (key, storage_nbytes) counts once (Tally.share). */
static PyObject *share(Tally *self, PyObject *t, long long nbytes, PyObject *storage,
                       PyObject *key, long long storage_nbytes, int unlink) {
    Shared *entry = (Shared *)PyDict_GetItemWithError(self->shared, key); /* borrowed */
    if (entry == NULL && PyErr_Occurred())
        return NULL;
    int hit = entry != NULL;
    if (hit) {
        Py_INCREF(entry);
    } else {
        if (free_weak_ref == NULL) {
            free_weak_ref = PyObject_GetAttrString((PyObject *)Py_TYPE(storage), "_free_weak_ref");
            if (free_weak_ref == NULL)
                return NULL;
        }
        entry = PyObject_New(Shared, &SharedType);
        if (entry == NULL)
            return NULL;
        entry->key = Py_NewRef(key);
        entry->nbytes = storage_nbytes;
        entry->count = 0;
        entry->weak = PyObject_CallMethodNoArgs(storage, s_weak_ref);
        if (entry->weak == NULL || PyDict_SetItem(self->shared, key, (PyObject *)entry) < 0) {
            Py_DECREF(entry);
            return NULL;
        }
    }
    /* Claimed before keep(), which runs Python code (detach) during which the entry's other
     * Helds may go: it must not be dropped meanwhile. */
    entry->count += 1;
    Held *h = (Held *)keep(self, t, nbytes, hit ? 0 : storage_nbytes, unlink);
    if (h == NULL) {
        if (--entry->count == 0) {
            if (hit) /* its bytes were counted by its first save, and its others went */
                self->now -= entry->nbytes;
            forget_shared(self, entry);
        }
        Py_DECREF(entry);
        return NULL;
    }
    if (hit)
        self->deduplicated_bytes += nbytes;
    /* the bytes now held are the entry's: taken off when its last Held goes (release_shared) */
    h->nbytes = 0;
    h->shared = entry;
    return (PyObject *)h;
}

static PyObject *tally_keep(Tally *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "keep(tensor, nbytes, resident)");
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[1]);
    long long resident = PyLong_AsLongLong(args[2]);
    if ((nbytes == -1 || resident == -1) && PyErr_Occurred())
        return NULL;
    return keep(self, args[0], nbytes, resident, UNLINK_ASK);
}

static PyObject *tally_share(Tally *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "share(tensor, nbytes)");
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[1]);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    PyObject *storage, *key;
    long long storage_nbytes;
    int r = storage_of(args[0], &storage, &key, &storage_nbytes);
    if (r <= 0) {
        if (r == 0)
            PyErr_SetString(PyExc_ValueError, "share: the tensor has no storage");
        return NULL;
    }
    PyObject *h = share(self, args[0], nbytes, storage, key, storage_nbytes, UNLINK_ASK);
    Py_DECREF(key);
    Py_DECREF(storage);
    return h;
}

static PyObject *tally_take(Tally *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = Py_BuildValue("(LLLLL)", self->saved, self->saved_bytes,
                                  self->deduplicated_bytes, self->now, self->peak);
    if (out != NULL) {
        self->saved = 0;
        self->saved_bytes = 0;
        self->deduplicated_bytes = 0;
        self->peak = self->now;
    }
    return out;
}

static PyObject *tally_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Tally *self = (Tally *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->shared = PyDict_New();
    if (self->shared == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void tally_dealloc(Tally *self) {
    Py_CLEAR(self->shared); /* empty: every Held holds the tally */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef tally_methods[] = {
    {"keep", (PyCFunction)(void (*)(void))tally_keep, METH_FASTCALL,
     "keep(tensor, nbytes, resident) -> Held"},
    {"share", (PyCFunction)(void (*)(void))tally_share, METH_FASTCALL,
     "share(tensor, nbytes) -> Held, its storage's bytes counted once"},
    {"take", (PyCFunction)tally_take, METH_NOARGS,
     "take() -> (saved, saved_bytes, deduplicated_bytes, now, peak) since the last take"},
    {NULL},
};

static PyMemberDef tally_members[] = {
    {"now", T_LONGLONG, offsetof(Tally, now), READONLY, "resident bytes held now"},
    {NULL},
};

static PyTypeObject TallyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.runtime._held.Tally",
    .tp_basicsize = sizeof(Tally),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The count and bytes of saved tensors kept as they are.",
    .tp_new = tally_new,
    .tp_dealloc = (destructor)tally_dealloc,
    .tp_methods = tally_methods,
    .tp_members = tally_members,
};


/* -- the hooks ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *dict;
    Tally *tally;
    long long min_bytes;
    PyObject *index;  /* tier keep: the StorageIndex (else None); tensors kept through share */
    PyObject *params; /* its parameters' storages, {StorageImpl address: StorageWeakRef} */
    PyObject *captures, *evicted, *slow, *tensor_type, *parameter_type, *strided, *is_parameter;
} Pack;

typedef struct {
    PyObject_HEAD
    PyObject *dict;
    PyObject *slow;
} Unpack;

static PyTypeObject PackType;

/* 1 if ``obj.name()`` is true, 0 if not, -1 on error. */
static int attr_true_call(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_CallMethodNoArgs(obj, name);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The resident bytes of a small plain tensor: 0 for a parameter or a view of one. */
static long long resident_of(Pack *self, PyObject *t, long long nbytes) {
    /* the instance dict as it is: asking for ``__dict__`` would make one for every tensor */
    PyObject **dp = _PyObject_GetDictPtr(t);
    Py_ssize_t attrs = 1;
    if (dp == NULL || *dp == NULL)
        attrs = 0;
    else if (PyDict_Check(*dp))
        attrs = PyDict_GET_SIZE(*dp);
    int param;
    if (attrs) { /* attributes: offloadd's is_parameter in Python decides */
        PyObject *r = PyObject_CallOneArg(self->is_parameter, t);
        if (r == NULL)
            return -1;
        param = PyObject_IsTrue(r);
        Py_DECREF(r);
    } else {
        PyObject *base = PyObject_GetAttr(t, s_base);
        if (base == NULL)
            return -1;
        param = base == Py_None ? 0 : PyObject_IsInstance(base, self->parameter_type);
        Py_DECREF(base);
    }
    if (param < 0)
        return -1;
    return param ? 0 : nbytes;
}

/* Tier keep, a plain tensor with storage ``key`` that is no parameter's view and does not
 * require grad (one that does is an op's output or an input, never a module's storage): 1 if it
 * is a module's storage (the index's parameters and buffers, see [parameters learned] in
 * dedup.py), 0 if not, 2 if the index must learn first (slow asks it), -1 on error. */
static int known_parameter(Pack *self, PyObject *key) {
    int r;
    PyObject *ref = PyDict_GetItemWithError(self->params, key); /* borrowed */
    if (ref == NULL && PyErr_Occurred())
        return -1;
    if (ref != NULL) {
        r = attr_true_call(ref, s_expired);
        if (r <= 0)
            return r < 0 ? -1 : 1;
    }
    PyObject *learned = PyObject_GetAttr(self->index, s_learned);
    PyObject *step = learned == NULL ? NULL : PyObject_GetAttr(self->index, s_step);
    r = step == NULL ? -1 : PyObject_RichCompareBool(learned, step, Py_EQ);
    Py_XDECREF(learned);
    Py_XDECREF(step);
    return r < 0 ? -1 : (r ? 0 : 2);
}

static PyObject *pack_call(Pack *self, PyObject *args, PyObject *kwargs) {
    PyObject *t;
    if (!PyArg_UnpackTuple(args, "pack", 1, 1, &t))
        return NULL;
    int r = held_attr_true(self->captures, s_num_pending);
    if (r != 0)
        goto slow;
    r = held_attr_true(self->evicted, s_claims);
    PyObject *type = (PyObject *)Py_TYPE(t);
    if (r != 0 || (type != self->tensor_type && type != self->parameter_type))
        goto slow;
    PyObject *layout = PyObject_GetAttr(t, s_layout);
    if (layout == NULL)
        return NULL;
    Py_DECREF(layout); /* compared by identity: torch.strided lives as long as torch */
    if (layout != self->strided)
        goto slow;
    r = held_attr_true(t, s_is_meta);
    if (r != 0)
        goto slow;
    PyObject *n = PyObject_GetAttr(t, s_nbytes);
    if (n == NULL)
        return NULL;
    long long nbytes = PyLong_AsLongLong(n);
    Py_DECREF(n);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    if (type == self->parameter_type) /* held by the model anyway, whatever its size */
        return keep(self->tally, t, nbytes, 0, UNLINK_NO);
    if (nbytes >= self->min_bytes && nbytes != 0) {
        if (self->index == Py_None)
            goto slow;
        long long resident = resident_of(self, t, nbytes);
        if (resident <= 0) /* a parameter's view, or an error */
            return resident < 0 ? NULL : keep(self->tally, t, nbytes, 0, UNLINK_ASK);
        PyObject *storage, *key;
        long long storage_nbytes;
        r = storage_of(t, &storage, &key, &storage_nbytes);
        if (r <= 0)
            goto slow; /* no storage of its own (slow decides), or an error */
        int requires = held_attr_true(t, s_requires_grad);
        int param = requires < 0 ? -1 : requires ? 0 : known_parameter(self, key);
        PyObject *h = NULL;
        if (param == 0)
            h = share(self->tally, t, nbytes, storage, key, storage_nbytes, requires);
        else if (param == 1)
            h = keep(self->tally, t, nbytes, 0, UNLINK_NO);
        Py_DECREF(key);
        Py_DECREF(storage);
        if (param == 2)
            goto slow;
        return h;
    }
    long long resident = resident_of(self, t, nbytes);
    if (resident < 0)
        return NULL;
    return keep(self->tally, t, nbytes, resident, UNLINK_ASK);
slow:
    if (r < 0)
        return NULL;
    return PyObject_CallOneArg(self->slow, t);
}

/* Release what the hook holds, its __dict__ aside. */
static void pack_drop(Pack *self) {
    Py_CLEAR(self->tally);
    Py_CLEAR(self->index);
    Py_CLEAR(self->params);
    Py_CLEAR(self->captures);
    Py_CLEAR(self->evicted);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->parameter_type);
    Py_CLEAR(self->strided);
    Py_CLEAR(self->is_parameter);
}

static int pack_init(Pack *self, PyObject *args, PyObject *kwargs) {
    /* parsed into locals (borrowed), kept only once nothing can fail: dealloc releases
     * whatever self holds */
    PyObject *tally, *index, *captures, *evicted, *slow, *tensor_type, *parameter_type, *strided,
        *is_parameter, *params = NULL;
    long long min_bytes;
    if (!PyArg_ParseTuple(args, "O!LOOOOOOOO:Pack", &TallyType, &tally, &min_bytes, &index,
                          &captures, &evicted, &slow, &tensor_type, &parameter_type, &strided,
                          &is_parameter))
        return -1;
    if (index != Py_None) {
        params = PyObject_GetAttr(index, s_params);
        if (params == NULL)
            return -1;
        if (!PyDict_Check(params)) {
            Py_DECREF(params);
            PyErr_SetString(PyExc_TypeError, "Pack: index._params is not a dict");
            return -1;
        }
    }
    pack_drop(self); /* __init__ called again: the earlier references go */
    self->min_bytes = min_bytes;
    self->params = params;
    self->index = Py_NewRef(index);
    self->tally = (Tally *)Py_NewRef(tally);
    self->captures = Py_NewRef(captures);
    self->evicted = Py_NewRef(evicted);
    self->slow = Py_NewRef(slow);
    self->tensor_type = Py_NewRef(tensor_type);
    self->parameter_type = Py_NewRef(parameter_type);
    self->strided = Py_NewRef(strided);
    self->is_parameter = Py_NewRef(is_parameter);
    return 0;
}

static int pack_traverse(Pack *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    Py_VISIT(self->tally);
    Py_VISIT(self->index);
    Py_VISIT(self->params);
    Py_VISIT(self->captures);
    Py_VISIT(self->evicted);
    Py_VISIT(self->slow);
    Py_VISIT(self->is_parameter);
    return 0;
}

static int pack_clear(Pack *self) {
    Py_CLEAR(self->dict);
    pack_drop(self);
    return 0;
}

static void pack_dealloc(Pack *self) {
    PyObject_GC_UnTrack(self);
    pack_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PackType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.runtime._held.Pack",
    .tp_basicsize = sizeof(Pack),
    .tp_dictoffset = offsetof(Pack, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "offloadd's pack hook: small plain tensors kept here, the rest passed to slow.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pack_init,
    .tp_call = (ternaryfunc)pack_call,
    .tp_traverse = (traverseproc)pack_traverse,
    .tp_clear = (inquiry)pack_clear,
    .tp_dealloc = (destructor)pack_dealloc,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
};

static PyObject *unpack_call(Unpack *self, PyObject *args, PyObject *kwargs) {
    PyObject *p;
    if (!PyArg_UnpackTuple(args, "unpack", 1, 1, &p))
        return NULL;
    if (Py_TYPE(p) == &HeldType) {
        Held *h = (Held *)p;
        PyObject *v = PyObject_GetAttr(h->tensor, s_version);
        if (v == NULL)
            return NULL;
        int same = PyObject_RichCompareBool(v, h->version, Py_EQ);
        Py_DECREF(v);
        if (same < 0)
            return NULL;
        if (same)
            return Py_NewRef(h->tensor);
    }
    return PyObject_CallOneArg(self->slow, p); /* anything else, or PyTorch's in-place error */
}

static int unpack_init(Unpack *self, PyObject *args, PyObject *kwargs) {
    PyObject *slow;
    if (!PyArg_ParseTuple(args, "O:Unpack", &slow))
        return -1;
    self->slow = Py_NewRef(slow);
    return 0;
}

static int unpack_traverse(Unpack *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    Py_VISIT(self->slow);
    return 0;
}

static int unpack_clear(Unpack *self) {
    Py_CLEAR(self->dict);
    Py_CLEAR(self->slow);
    return 0;
}

static void unpack_dealloc(Unpack *self) {
    PyObject_GC_UnTrack(self);
    unpack_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject UnpackType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.runtime._held.Unpack",
    .tp_basicsize = sizeof(Unpack),
    .tp_dictoffset = offsetof(Unpack, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "offloadd's unpack hook: a Held's tensor when unchanged, the rest passed to slow.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)unpack_init,
    .tp_call = (ternaryfunc)unpack_call,
    .tp_traverse = (traverseproc)unpack_traverse,
    .tp_clear = (inquiry)unpack_clear,
    .tp_dealloc = (destructor)unpack_dealloc,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "offloadd.runtime._held",
    .m_doc = "Saved tensors kept as they are, and their tally (csrc/hot_path/held.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__held(void) {
    s_requires_grad = PyUnicode_InternFromString("requires_grad");
    s_detach = PyUnicode_InternFromString("detach");
    s_version = PyUnicode_InternFromString("_version");
    s_num_pending = PyUnicode_InternFromString("num_pending");
    s_claims = PyUnicode_InternFromString("claims");
    s_layout = PyUnicode_InternFromString("layout");
    s_is_meta = PyUnicode_InternFromString("is_meta");
    s_nbytes = PyUnicode_InternFromString("nbytes");
    s_base = PyUnicode_InternFromString("_base");
    s_untyped_storage = PyUnicode_InternFromString("untyped_storage");
    s_cdata = PyUnicode_InternFromString("_cdata");
    s_expired = PyUnicode_InternFromString("expired");
    s_learned = PyUnicode_InternFromString("_learned");
    s_step = PyUnicode_InternFromString("step");
    s_params = PyUnicode_InternFromString("_params");
    s_weak_ref = PyUnicode_InternFromString("_weak_ref");
    if (s_requires_grad == NULL || s_detach == NULL || s_version == NULL ||
        s_num_pending == NULL || s_claims == NULL || s_layout == NULL || s_is_meta == NULL ||
        s_nbytes == NULL || s_base == NULL || s_untyped_storage == NULL ||
        s_cdata == NULL || s_expired == NULL || s_learned == NULL || s_step == NULL ||
        s_params == NULL || s_weak_ref == NULL)
        return NULL;
    if (PyType_Ready(&TallyType) < 0 || PyType_Ready(&HeldType) < 0 ||
        PyType_Ready(&SharedType) < 0 ||
        PyType_Ready(&PackType) < 0 || PyType_Ready(&UnpackType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Tally", (PyObject *)&TallyType) < 0 ||
        PyModule_AddObjectRef(m, "Held", (PyObject *)&HeldType) < 0 ||
        PyModule_AddObjectRef(m, "Pack", (PyObject *)&PackType) < 0 ||
        PyModule_AddObjectRef(m, "Unpack", (PyObject *)&UnpackType) < 0 ||
        passing_add(m) < 0 || PyModule_AddIntConstant(m, "VERSION", 3) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
