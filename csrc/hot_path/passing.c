/* offloadd.runtime._held's PassPack and PassUnpack: relay's saved-tensor pair, for the tensors
 * it passes on.
 *
 * While a relayed group's forward runs, relay's pair is on top of autograd's hooks. It turns a
 * saved view of the group's weights into a reference to the group (relay/backward.py) and
 * passes every other tensor, most of what the layer saves, to the hooks below it, or keeps it
 * as it is where there are none. In Python each of those tensors cost the pair two frames a
 * pack and two an unpack (the hook, and the wrapper that hides it from dynamo). Here the passing
 * is done in C, without a Python frame (none for dynamo to catch: see [invisible to dynamo] in
 * compiled.py); whatever may be a weight goes to relay's Python hooks.
 *
 * PassPack(slabs, slow, outer, tensor_type, parameter_type):
 *   for a tensor of exactly tensor_type or parameter_type whose storage's key
 *   (``t.untyped_storage()._cdata``) is not in the dict ``slabs``: outer(t), or, where outer is
 *   None, t (detached where it has a grad_fn: see pass_kept). Anything else (a weight's view,
 *   a subclass, a tensor without a storage of its own) goes to slow(t), which decides as
 *   relay's Python pack does.
 * PassUnpack(ref_type, slow, outer):
 *   slow(x) for an x of exactly ref_type (relay's WeightRef), else outer(x), or x where outer is
 *   None.
 * Both have a __dict__ (the marks offloadd puts on a pack hook).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "passing.h"

typedef struct {
    PyObject_HEAD
    PyObject *dict;
    PyObject *slabs; /* dict: storage key -> group, the slabs swapped in */
    PyObject *slow;
    PyObject *outer; /* the pack below ours, or None */
    PyObject *tensor_type;
    PyObject *parameter_type;
} PassPack;

typedef struct {
    PyObject_HEAD
    PyObject *dict;
    PyObject *ref_type;
    PyObject *slow;
    PyObject *outer; /* the unpack below ours, or None */
} PassUnpack;

static PyObject *s_untyped_storage, *s_cdata, *s_is_leaf, *s_detach;

/* outer(x), or x where outer is None */
static PyObject *pass_on(PyObject *outer, PyObject *x) {
    if (outer == Py_None)
        return Py_NewRef(x);
    return PyObject_CallOneArg(outer, x);
}

/* What the pack keeps of a tensor it passes where no hooks are below: the tensor, detached where
 * it has a grad_fn (it is no leaf), or an op's output saved by that op would be a cycle
 * through the graph that no collection frees (Note [passed on detached] in relay/backward.py). */
static PyObject *pass_kept(PyObject *outer, PyObject *t) {
    if (outer != Py_None)
        return PyObject_CallOneArg(outer, t);
    int leaf = held_attr_true(t, s_is_leaf); /* a tensor that requires no grad is a leaf */
    if (leaf < 0)
        return NULL;
    return leaf ? Py_NewRef(t) : PyObject_CallMethodNoArgs(t, s_detach);
}

static PyObject *pass_pack_call(PassPack *self, PyObject *args, PyObject *kwargs) {
    PyObject *t;
    if (!PyArg_UnpackTuple(args, "pack", 1, 1, &t))
        return NULL;
    PyObject *type = (PyObject *)Py_TYPE(t);
    if (type != self->tensor_type && type != self->parameter_type)
        return PyObject_CallOneArg(self->slow, t);
    PyObject *storage = PyObject_CallMethodNoArgs(t, s_untyped_storage);
    if (storage == NULL) { /* no storage of its own (a functional wrapper): slow decides */
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;
        PyErr_Clear();
        return PyObject_CallOneArg(self->slow, t);
    }
    PyObject *key = PyObject_GetAttr(storage, s_cdata);
    Py_DECREF(storage);
    if (key == NULL)
        return NULL;
    int mine = PyDict_Contains(self->slabs, key);
    Py_DECREF(key);
    if (mine < 0)
        return NULL;
    if (mine)
        return PyObject_CallOneArg(self->slow, t);
    return pass_kept(self->outer, t);
}

static int pass_pack_init(PassPack *self, PyObject *args, PyObject *kwargs) {
    PyObject *slabs, *slow, *outer, *tensor_type, *parameter_type;
    if (!PyArg_ParseTuple(args, "O!OOOO:PassPack", &PyDict_Type, &slabs, &slow, &outer,
                          &tensor_type, &parameter_type))
        return -1;
    Py_XSETREF(self->slabs, Py_NewRef(slabs));
    Py_XSETREF(self->slow, Py_NewRef(slow));
    Py_XSETREF(self->outer, Py_NewRef(outer));
    Py_XSETREF(self->tensor_type, Py_NewRef(tensor_type));
    Py_XSETREF(self->parameter_type, Py_NewRef(parameter_type));
    return 0;
}

static int pass_pack_traverse(PassPack *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    Py_VISIT(self->slabs);
    Py_VISIT(self->slow);
    Py_VISIT(self->outer);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->parameter_type);
    return 0;
}

static int pass_pack_clear(PassPack *self) {
    Py_CLEAR(self->dict);
    Py_CLEAR(self->slabs);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->outer);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->parameter_type);
    return 0;
}

static void pass_pack_dealloc(PassPack *self) {
    PyObject_GC_UnTrack(self);
    pass_pack_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PassPackType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.runtime._held.PassPack",
    .tp_basicsize = sizeof(PassPack),
    .tp_dictoffset = offsetof(PassPack, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "relay's pack hook: tensors on no slab passed on, the rest given to slow.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pass_pack_init,
    .tp_call = (ternaryfunc)pass_pack_call,
    .tp_traverse = (traverseproc)pass_pack_traverse,
    .tp_clear = (inquiry)pass_pack_clear,
    .tp_dealloc = (destructor)pass_pack_dealloc,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
};

static PyObject *pass_unpack_call(PassUnpack *self, PyObject *args, PyObject *kwargs) {
    PyObject *x;
    if (!PyArg_UnpackTuple(args, "unpack", 1, 1, &x))
        return NULL;
    if ((PyObject *)Py_TYPE(x) == self->ref_type)
        return PyObject_CallOneArg(self->slow, x);
    return pass_on(self->outer, x);
}

static int pass_unpack_init(PassUnpack *self, PyObject *args, PyObject *kwargs) {
    PyObject *ref_type, *slow, *outer;
    if (!PyArg_ParseTuple(args, "O!OO:PassUnpack", &PyType_Type, &ref_type, &slow, &outer))
        return -1;
    Py_XSETREF(self->ref_type, Py_NewRef(ref_type));
    Py_XSETREF(self->slow, Py_NewRef(slow));
    Py_XSETREF(self->outer, Py_NewRef(outer));
    return 0;
}

static int pass_unpack_traverse(PassUnpack *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    Py_VISIT(self->ref_type);
    Py_VISIT(self->slow);
    Py_VISIT(self->outer);
    return 0;
}

static int pass_unpack_clear(PassUnpack *self) {
    Py_CLEAR(self->dict);
    Py_CLEAR(self->ref_type);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->outer);
    return 0;
}

static void pass_unpack_dealloc(PassUnpack *self) {
    PyObject_GC_UnTrack(self);
    pass_unpack_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PassUnpackType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.runtime._held.PassUnpack",
    .tp_basicsize = sizeof(PassUnpack),
    .tp_dictoffset = offsetof(PassUnpack, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "relay's unpack hook: its refs given to slow, the rest passed on.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pass_unpack_init,
    .tp_call = (ternaryfunc)pass_unpack_call,
    .tp_traverse = (traverseproc)pass_unpack_traverse,
    .tp_clear = (inquiry)pass_unpack_clear,
    .tp_dealloc = (destructor)pass_unpack_dealloc,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
};

int passing_add(PyObject *m) {
    s_untyped_storage = PyUnicode_InternFromString("untyped_storage");
    s_cdata = PyUnicode_InternFromString("_cdata");
    s_is_leaf = PyUnicode_InternFromString("is_leaf");
    s_detach = PyUnicode_InternFromString("detach");
    if (s_untyped_storage == NULL || s_cdata == NULL || s_is_leaf == NULL || s_detach == NULL)
        return -1;
    if (PyType_Ready(&PassPackType) < 0 || PyType_Ready(&PassUnpackType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "PassPack", (PyObject *)&PassPackType) < 0 ||
        PyModule_AddObjectRef(m, "PassUnpack", (PyObject *)&PassUnpackType) < 0)
        return -1;
    return 0;
}
