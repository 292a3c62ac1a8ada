/* The items of a sequence a compiled parser takes from Python, held where the caller
 * cannot change them under it.
 *
 * PySequence_Fast hands a list back as it is, and converting an item (__index__, a
 * buffer) can run Python that empties that list: the items the parser reads next are
 * then freed (kvtier.transfer._native, kvtier.storage._pageio and kvtier.pools._indices
 * all crashed so). A tuple cannot change; any other iterable becomes a new list.
 */
#ifndef KVTIER_SEQUENCES_H
#define KVTIER_SEQUENCES_H

#include <Python.h>

/* obj's items as a tuple or a new list (read with PySequence_Fast_GET_*), or NULL with
 * what as the TypeError where obj is not iterable. */
static inline PyObject *held_items(PyObject *obj, const char *what) {
    return PyList_Check(obj) ? PyList_AsTuple(obj) : PySequence_Fast(obj, what);
}

#endif
