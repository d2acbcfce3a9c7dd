/* settled.boundary._linux: the C binding of boundary/linux.py.
 *
 * The Linux calls a session owner makes on its launch path, before its command runs: clone3
 * (CLONE_INTO_CGROUP, CLONE_NEWPID), unshare, mount, mount_setattr, pivot_root, umount2, prctl,
 * capget, capset, fcntl with an integer argument (pipe sizes, seals: the fcntl module is one
 * more library), and joining the task's pod: setns, keyctl, a seccomp filter; with what making
 * a pod takes (sethostname).
 * Python 3.11 has none of them; ctypes reaches them too (boundary/linux_ctypes.py, the
 * fallback the tests also run), but importing ctypes costs a fresh owner ~2 ms here and each
 * call through it ~10 us, where a command's isolation makes dozens.
 *
 * Owns only the calls: each returns the system call's result, or -errno on failure, and
 * linux.py turns that into OSError. Never decides what to call.
 *
 * clone3 may ask for CLONE_PARENT (the placer's: its child is its owner's), with exit_signal 0.
 *
 * clone3 keeps the GIL held across the call (no Py_BEGIN_ALLOW_THREADS): the child returns
 * into Python as a copy of the calling thread alone, which must hold the GIL in both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef CLONE_PARENT
#define CLONE_PARENT 0x00008000
#endif

struct settled_clone_args { /* struct clone_args up to cgroup: CLONE_ARGS_SIZE_VER2 */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};

struct settled_mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

struct settled_cap_header {
    uint32_t version;
    int pid;
};

struct settled_cap_data {
    uint32_t effective, permitted, inheritable;
};

#define CAP_VERSION_3 0x20080522

static long result(long value) { return value < 0 ? -errno : value; }

static PyObject *m_clone3(PyObject *self, PyObject *args) {
    unsigned long long flags;
    int cgroup;
    if (!PyArg_ParseTuple(args, "Ki", &flags, &cgroup))
        return NULL;
    int pidfd = -1;
    struct settled_clone_args clone_args;
    memset(&clone_args, 0, sizeof clone_args);
    clone_args.flags = flags | CLONE_PIDFD;
    clone_args.pidfd = (uint64_t)(uintptr_t)&pidfd;
    /* CLONE_PARENT refuses an exit signal (EINVAL): the child then takes the caller's own,
     * and its parent is the caller's parent (the placer's owner, boundary/placer.py). */
    clone_args.exit_signal = (flags & CLONE_PARENT) ? 0 : SIGCHLD;
    if (flags & CLONE_INTO_CGROUP)
        clone_args.cgroup = (uint64_t)(int64_t)cgroup;
    long pid = syscall(SYS_clone3, &clone_args, sizeof clone_args);
    if (pid < 0)
        return Py_BuildValue("(li)", (long)-errno, -1);
    return Py_BuildValue("(li)", pid, pid == 0 ? -1 : pidfd);
}

static PyObject *m_unshare(PyObject *self, PyObject *args) {
    int flags;
    if (!PyArg_ParseTuple(args, "i", &flags))
        return NULL;
    return PyLong_FromLong(result(unshare(flags)));
}

static PyObject *m_mount(PyObject *self, PyObject *args) {
    Py_buffer source, target, fstype, data;
    unsigned long flags;
    if (!PyArg_ParseTuple(args, "z*y*z*kz*", &source, &target, &fstype, &flags, &data))
        return NULL;
    long value = result(mount(source.buf, target.buf, fstype.buf, flags, data.buf));
    PyBuffer_Release(&source);
    PyBuffer_Release(&target);
    PyBuffer_Release(&fstype);
    PyBuffer_Release(&data);
    return PyLong_FromLong(value);
}

static PyObject *m_mount_setattr(PyObject *self, PyObject *args) {
    int dirfd;
    Py_buffer path;
    unsigned int at_flags;
    unsigned long long attr_set, attr_clr;
    if (!PyArg_ParseTuple(args, "iy*IKK", &dirfd, &path, &at_flags, &attr_set, &attr_clr))
        return NULL;
    struct settled_mount_attr attr = {attr_set, attr_clr, 0, 0};
    long value = result(
        syscall(SYS_mount_setattr, dirfd, path.buf, at_flags, &attr, sizeof attr));
    PyBuffer_Release(&path);
    return PyLong_FromLong(value);
}

static PyObject *m_pivot_root(PyObject *self, PyObject *args) {
    Py_buffer new_root, put_old;
    if (!PyArg_ParseTuple(args, "y*y*", &new_root, &put_old))
        return NULL;
    long value = result(syscall(SYS_pivot_root, new_root.buf, put_old.buf));
    PyBuffer_Release(&new_root);
    PyBuffer_Release(&put_old);
    return PyLong_FromLong(value);
}

static PyObject *m_umount2(PyObject *self, PyObject *args) {
    Py_buffer target;
    int flags;
    if (!PyArg_ParseTuple(args, "y*i", &target, &flags))
        return NULL;
    long value = result(umount2(target.buf, flags));
    PyBuffer_Release(&target);
    return PyLong_FromLong(value);
}

static PyObject *m_prctl(PyObject *self, PyObject *args) {
    int option;
    unsigned long arg2 = 0, arg3 = 0, arg4 = 0, arg5 = 0;
    if (!PyArg_ParseTuple(args, "i|kkkk", &option, &arg2, &arg3, &arg4, &arg5))
        return NULL;
    return PyLong_FromLong(result(prctl(option, arg2, arg3, arg4, arg5)));
}

static PyObject *m_capget(PyObject *self, PyObject *unused) {
    struct settled_cap_header header = {CAP_VERSION_3, 0};
    struct settled_cap_data data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capget, &header, data) < 0)
        return Py_BuildValue("(iKKK)", -errno, 0ULL, 0ULL, 0ULL);
    return Py_BuildValue(
        "(iKKK)", 0,
        (unsigned long long)data[0].effective | (unsigned long long)data[1].effective << 32,
        (unsigned long long)data[0].permitted | (unsigned long long)data[1].permitted << 32,
        (unsigned long long)data[0].inheritable | (unsigned long long)data[1].inheritable << 32);
}

static PyObject *m_capset(PyObject *self, PyObject *args) {
    unsigned long long effective, permitted, inheritable;
    if (!PyArg_ParseTuple(args, "KKK", &effective, &permitted, &inheritable))
        return NULL;
    struct settled_cap_header header = {CAP_VERSION_3, 0};
    struct settled_cap_data data[2] = {
        {(uint32_t)effective, (uint32_t)permitted, (uint32_t)inheritable},
        {(uint32_t)(effective >> 32), (uint32_t)(permitted >> 32), (uint32_t)(inheritable >> 32)},
    };
    return PyLong_FromLong(result(syscall(SYS_capset, &header, data)));
}

static PyObject *m_fcntl(PyObject *self, PyObject *args) {
    int fd, cmd;
    long arg;
    if (!PyArg_ParseTuple(args, "iil", &fd, &cmd, &arg))
        return NULL;
    return PyLong_FromLong(result(fcntl(fd, cmd, arg)));
}

/* poll(2) of up to 8 descriptors for POLLIN, the GIL released while it waits: the owner's
 * first drain (owner/early.py) waits on its pipes here, without loading the select module
 * (~0.5 ms of a fresh owner's launch path). Returns the ready descriptors, or -errno. */
static PyObject *m_poll_in(PyObject *self, PyObject *args) {
    PyObject *seq;
    int timeout;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &timeout))
        return NULL;
    struct pollfd fds[8];
    Py_ssize_t count = PySequence_Length(seq);
    if (count < 0)
        return NULL;
    if (count > 8) {
        PyErr_SetString(PyExc_ValueError, "poll_in: at most 8 descriptors");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (item == NULL)
            return NULL;
        fds[i].fd = (int)PyLong_AsLong(item);
        Py_DECREF(item);
        if (fds[i].fd == -1 && PyErr_Occurred())
            return NULL;
        fds[i].events = POLLIN;
        fds[i].revents = 0;
    }
    int ready;
    Py_BEGIN_ALLOW_THREADS
    ready = poll(fds, (nfds_t)count, timeout);
    Py_END_ALLOW_THREADS
    if (ready < 0)
        return PyLong_FromLong(-errno);
    PyObject *found = PyList_New(0);
    if (found == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (fds[i].revents) {
            PyObject *fd = PyLong_FromLong(fds[i].fd);
            if (fd == NULL || PyList_Append(found, fd) < 0) {
                Py_XDECREF(fd);
                Py_DECREF(found);
                return NULL;
            }
            Py_DECREF(fd);
        }
    }
    return found;
}

static PyObject *m_setns(PyObject *self, PyObject *args) {
    int fd, nstype;
    if (!PyArg_ParseTuple(args, "ii", &fd, &nstype))
        return NULL;
    return PyLong_FromLong(result(setns(fd, nstype)));
}

static PyObject *m_sethostname(PyObject *self, PyObject *args) {
    Py_buffer name;
    if (!PyArg_ParseTuple(args, "y*", &name))
        return NULL;
    long value = result(sethostname(name.buf, (size_t)name.len));
    PyBuffer_Release(&name);
    return PyLong_FromLong(value);
}

static PyObject *m_keyctl(PyObject *self, PyObject *args) {
    int operation;
    unsigned long arg2 = 0, arg3 = 0, arg4 = 0, arg5 = 0;
    if (!PyArg_ParseTuple(args, "i|kkkk", &operation, &arg2, &arg3, &arg4, &arg5))
        return NULL;
    return PyLong_FromLong(result(syscall(SYS_keyctl, operation, arg2, arg3, arg4, arg5)));
}

static PyObject *m_keyctl_name(PyObject *self, PyObject *args) {
    int operation;
    Py_buffer name;
    if (!PyArg_ParseTuple(args, "iy*", &operation, &name))
        return NULL;
    long value = result(syscall(SYS_keyctl, operation, (const char *)name.buf, 0, 0, 0));
    PyBuffer_Release(&name);
    return PyLong_FromLong(value);
}

static PyObject *m_seccomp_filter(PyObject *self, PyObject *args) {
    Py_buffer program;
    if (!PyArg_ParseTuple(args, "y*", &program))
        return NULL;
    if (program.len % sizeof(struct sock_filter) != 0 ||
        program.len / sizeof(struct sock_filter) > BPF_MAXINSNS) {
        PyBuffer_Release(&program);
        return PyLong_FromLong(-EINVAL);
    }
    struct sock_fprog fprog = {
        (unsigned short)(program.len / sizeof(struct sock_filter)),
        (struct sock_filter *)program.buf,
    };
    long value = result(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0));
    PyBuffer_Release(&program);
    return PyLong_FromLong(value);
}

static PyMethodDef methods[] = {
    {"fcntl", m_fcntl, METH_VARARGS, "fcntl(fd, cmd, int_arg) -> result or -errno."},
    {"setns", m_setns, METH_VARARGS, "setns(fd, nstype) -> 0 or -errno."},
    {"poll_in", m_poll_in, METH_VARARGS,
     "poll_in(fds, timeout_ms) -> [ready fds] or -errno: poll(2) for POLLIN, GIL released."},
    {"sethostname", m_sethostname, METH_VARARGS, "sethostname(name) -> 0 or -errno."},
    {"keyctl", m_keyctl, METH_VARARGS,
     "keyctl(operation, arg2=0, arg3=0, arg4=0, arg5=0) -> result or -errno."},
    {"keyctl_name", m_keyctl_name, METH_VARARGS,
     "keyctl_name(operation, name) -> result or -errno: an operation whose one argument is a "
     "name (KEYCTL_JOIN_SESSION_KEYRING)."},
    {"seccomp_filter", m_seccomp_filter, METH_VARARGS,
     "seccomp_filter(program) -> 0 or -errno: install a classic BPF program (struct "
     "sock_filter array) as this thread's seccomp filter."},
    {"clone3", m_clone3, METH_VARARGS,
     "clone3(flags, cgroup_fd) -> (pid or -errno, pidfd); (0, -1) in the child."},
    {"unshare", m_unshare, METH_VARARGS, "unshare(flags) -> 0 or -errno."},
    {"mount", m_mount, METH_VARARGS,
     "mount(source, target, fstype, flags, data) -> 0 or -errno; None passes NULL."},
    {"mount_setattr", m_mount_setattr, METH_VARARGS,
     "mount_setattr(dirfd, path, at_flags, attr_set, attr_clr) -> 0 or -errno."},
    {"pivot_root", m_pivot_root, METH_VARARGS, "pivot_root(new_root, put_old) -> 0 or -errno."},
    {"umount2", m_umount2, METH_VARARGS, "umount2(target, flags) -> 0 or -errno."},
    {"prctl", m_prctl, METH_VARARGS, "prctl(option, arg2=0, arg3=0, arg4=0, arg5=0) -> result."},
    {"capget", m_capget, METH_NOARGS,
     "capget() -> (0 or -errno, effective, permitted, inheritable) of this thread."},
    {"capset", m_capset, METH_VARARGS, "capset(effective, permitted, inheritable) -> 0 or -errno."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "settled.boundary._linux",
    "The Linux calls of a session owner's launch path (boundary/linux.py is the interface).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__linux(void) { return PyModule_Create(&module); }
