/* settled.workspace._walk: the scanner's per-directory hot loop in C (walk.py is its twin).
 *
 * Owns scan_dirs(): list open directories with getdents64, lstat every entry relative to its
 * directory (fstatat with AT_SYMLINK_NOFOLLOW), and apply the stat cache to each file or
 * symlink exactly as walk.reusable does, so that a directory nothing changed in costs one
 * system call an entry and no Python bytecode. The system calls run without the GIL, the
 * directories of one call shared out over a few threads (git status lstats on threads too).
 *
 * Why: a full stat walk of 100,000 files spent ~0.19 s in os.stat (1.9 us a call, the
 * stat_result built each time) and ~0.15 s in the Python around it; git status does the same
 * walk in ~0.17 s. Here the walk is the kernel's time, on two cores, plus ~0.3 us an entry.
 *
 * And read_files() (read_files_start/_take: the same reads on a thread of their own, taken in
 * order while the caller hashes): the small regular files of a listing, each opened O_PATH
 * without following, fstat'd, and only a regular file reopened for reading.
 *
 * Must never: follow a symlink, open for reading anything but a file fstat showed to be
 * regular (it lists the directory fds it is given and names things relative to them), vouch
 * for an entry that walk.py's twin would re-read, swallow an error other than an entry that
 * vanished between the listing and its lstat, or leave a read running once its results were
 * all taken or its pending object is gone (the caller then closes the directory fd).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
#include <unistd.h>

/* Entry's fields (manifest.Entry, a NamedTuple): walk.py checks this layout at import. */
enum {
    E_TYPE = 1, E_MODE = 2, E_SIZE = 3, E_DIGEST = 4, E_TARGET = 5, E_INO = 7, E_DEV = 8,
    E_MTIME_NS = 9, E_CTIME_NS = 10, E_UID = 14, E_GID = 15, E_FIELDS = 18
};

#define COARSE_FS_SLACK_NS 2000000000LL
#define NS 1000000000LL
#define LIST_BUFFER (64 * 1024)
#define MAX_WORKERS 16
#define MIN_ITEMS_PER_WORKER 32 /* files (or directories) a thread must have to be started */

struct linux_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

typedef struct {
    size_t name; /* offset into the names arena */
    size_t length;
    struct stat st;
} item_t;

typedef struct {
    item_t *items;
    size_t count, capacity;
    char *names;
    size_t used, room;
    int error;           /* errno of the first failure, 0 if none */
    size_t error_name;   /* offset of the name it concerns, or (size_t)-1: the listing */
} listing_t;

static PyObject *stat_result_type = NULL;

static void listing_free(listing_t *l) {
    free(l->items);
    free(l->names);
}

static int listing_add(listing_t *l, const char *name, size_t length, const struct stat *st) {
    if (l->count == l->capacity) {
        size_t capacity = l->capacity ? l->capacity * 2 : 64;
        item_t *grown = realloc(l->items, capacity * sizeof(item_t));
        if (grown == NULL) return -1;
        l->items = grown;
        l->capacity = capacity;
    }
    if (l->used + length + 1 > l->room) {
        size_t room = l->room ? l->room * 2 : 4096;
        while (room < l->used + length + 1) room *= 2;
        char *grown = realloc(l->names, room);
        if (grown == NULL) return -1;
        l->names = grown;
        l->room = room;
    }
    memcpy(l->names + l->used, name, length + 1);
    item_t *item = &l->items[l->count++];
    item->name = l->used;
    item->length = length;
    item->st = *st;
    l->used += length + 1;
    return 0;
}

/* Without the GIL: every name of the directory and its lstat. Returns -1 on ENOMEM. */
static int list_entries(int fd, int list_fd, listing_t *l);

/* The listing reads its own open file of the directory ("." of fd: the very same directory,
 * nothing resolved), closed here on the walker's thread: the kernel's readdir state (ext4's
 * cache of the names read) is freed with the last close of the open file that read it, ~13 us
 * a directory here, which the caller's close of fd (on the scanner's one thread) paid before. */
static int list_and_stat(int fd, listing_t *l) {
    int list_fd = openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (list_fd < 0) { /* removed meanwhile, say: fd itself is listed, as it always was */
        if (lseek(fd, 0, SEEK_SET) < 0) {
            l->error = errno;
            l->error_name = (size_t)-1;
            return 0;
        }
        return list_entries(fd, fd, l);
    }
    int result = list_entries(fd, list_fd, l);
    close(list_fd);
    return result;
}

static int list_entries(int fd, int list_fd, listing_t *l) {
    char *buffer = malloc(LIST_BUFFER);
    if (buffer == NULL) return -1;
    for (;;) {
        long got = syscall(SYS_getdents64, list_fd, buffer, LIST_BUFFER);
        if (got < 0) {
            if (errno == EINTR) continue;
            l->error = errno;
            l->error_name = (size_t)-1;
            break;
        }
        if (got == 0) break;
        for (long at = 0; at < got;) {
            struct linux_dirent64 *d = (struct linux_dirent64 *)(buffer + at);
            at += d->d_reclen;
            const char *name = d->d_name;
            if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0')))
                continue;
            struct stat st;
            if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                if (errno == ENOENT) continue; /* vanished while listed */
                int saved = errno;
                memset(&st, 0, sizeof st);
                if (listing_add(l, name, strlen(name), &st) != 0) {
                    free(buffer);
                    return -1;
                }
                l->error = saved;
                l->error_name = l->items[l->count - 1].name;
                free(buffer);
                return 0;
            }
            if (listing_add(l, name, strlen(name), &st) != 0) {
                free(buffer);
                return -1;
            }
        }
    }
    free(buffer);
    return 0;
}

/* An int field of an Entry equals the C value (None, or anything else, never does). */
static int equals_signed(PyObject *value, long long expected) {
    if (!PyLong_CheckExact(value)) return 0;
    int overflow = 0;
    long long got = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (got == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return got == expected;
}

static int equals_unsigned(PyObject *value, unsigned long long expected) {
    if (!PyLong_CheckExact(value)) return 0;
    unsigned long long got = PyLong_AsUnsignedLongLong(value);
    if (got == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return got == expected;
}

static long long ns_of(const struct timespec *t) {
    return (long long)t->tv_sec * NS + t->tv_nsec;
}

/* scanrules.py's stat_verdict == REUSE: the cached entry of a file or symlink whose every stat field
 * matches, with both timestamps strictly older than the cutoff (the racy-git rule). 1, 0 or -1
 * (a Python error). */
static int reusable(PyObject *cached, const struct stat *st, long long cutoff) {
    if (!PyTuple_Check(cached) || PyTuple_GET_SIZE(cached) < E_FIELDS) return 0;
    PyObject *digest = PyTuple_GET_ITEM(cached, E_DIGEST);
    PyObject *target = PyTuple_GET_ITEM(cached, E_TARGET);
    int truthy = PyObject_IsTrue(digest);
    if (truthy < 0) return -1;
    if (!truthy && target == Py_None) return 0; /* (digest or target) is None */
    const char *kind;
    if (S_ISREG(st->st_mode)) kind = "file";
    else if (S_ISLNK(st->st_mode)) kind = "symlink";
    else return 0; /* a cached file or symlink is never another type */
    long long mtime = ns_of(&st->st_mtim), ctime = ns_of(&st->st_ctim);
    if (!equals_signed(PyTuple_GET_ITEM(cached, E_MTIME_NS), mtime)) return 0;
    if (!equals_signed(PyTuple_GET_ITEM(cached, E_CTIME_NS), ctime)) return 0;
    if (!equals_signed(PyTuple_GET_ITEM(cached, E_SIZE), (long long)st->st_size)) return 0;
    if (!equals_unsigned(PyTuple_GET_ITEM(cached, E_INO), (unsigned long long)st->st_ino))
        return 0;
    if (!equals_unsigned(PyTuple_GET_ITEM(cached, E_DEV), (unsigned long long)st->st_dev))
        return 0;
    if (!equals_signed(PyTuple_GET_ITEM(cached, E_MODE), (long long)(st->st_mode & 07777)))
        return 0;
    if (!equals_unsigned(PyTuple_GET_ITEM(cached, E_UID), (unsigned long long)st->st_uid))
        return 0;
    if (!equals_unsigned(PyTuple_GET_ITEM(cached, E_GID), (unsigned long long)st->st_gid))
        return 0;
    PyObject *type = PyTuple_GET_ITEM(cached, E_TYPE);
    if (!PyUnicode_Check(type) || PyUnicode_CompareWithASCIIString(type, kind) != 0) return 0;
    /* _trusted: the stat cache's racy-git rule, on the cached timestamps (equal to these) */
    long long limit = cutoff - (ctime % NS == 0 ? COARSE_FS_SLACK_NS : 0);
    return mtime < limit && ctime < limit;
}

static PyObject *stat_result_of(const struct stat *st) {
    PyObject *fields = PyTuple_New(19);
    if (fields == NULL) return NULL;
    long long times[3] = {ns_of(&st->st_atim), ns_of(&st->st_mtim), ns_of(&st->st_ctim)};
    PyObject *values[19] = {
        PyLong_FromUnsignedLong(st->st_mode),
        PyLong_FromUnsignedLongLong(st->st_ino),
        PyLong_FromUnsignedLongLong(st->st_dev),
        PyLong_FromUnsignedLongLong(st->st_nlink),
        PyLong_FromUnsignedLong(st->st_uid),
        PyLong_FromUnsignedLong(st->st_gid),
        PyLong_FromLongLong(st->st_size),
        PyLong_FromLongLong(st->st_atim.tv_sec),
        PyLong_FromLongLong(st->st_mtim.tv_sec),
        PyLong_FromLongLong(st->st_ctim.tv_sec),
        PyFloat_FromDouble((double)st->st_atim.tv_sec + st->st_atim.tv_nsec * 1e-9),
        PyFloat_FromDouble((double)st->st_mtim.tv_sec + st->st_mtim.tv_nsec * 1e-9),
        PyFloat_FromDouble((double)st->st_ctim.tv_sec + st->st_ctim.tv_nsec * 1e-9),
        PyLong_FromLongLong(times[0]),
        PyLong_FromLongLong(times[1]),
        PyLong_FromLongLong(times[2]),
        PyLong_FromLong(st->st_blksize),
        PyLong_FromLongLong(st->st_blocks),
        PyLong_FromUnsignedLongLong(st->st_rdev),
    };
    for (int i = 0; i < 19; i++) {
        if (values[i] == NULL) {
            for (int j = 0; j < 19; j++) Py_XDECREF(values[j]);
            Py_DECREF(fields);
            return NULL;
        }
    }
    for (int i = 0; i < 19; i++) PyTuple_SET_ITEM(fields, i, values[i]);
    PyObject *result = PyObject_CallOneArg(stat_result_type, fields);
    Py_DECREF(fields);
    return result;
}

static PyObject *raise_listing_error(listing_t *l) {
    errno = l->error;
    if (l->error_name == (size_t)-1) return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *name = PyUnicode_DecodeFSDefault(l->names + l->error_name);
    if (name == NULL) return NULL;
    PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    Py_DECREF(name);
    return NULL;
}

/* Under the GIL: the listing as (rows, fresh), or NULL with the exception set. */
static PyObject *classify(listing_t *l, PyObject *cached, long long cutoff) {
    if (l->error) return raise_listing_error(l);
    PyObject *rows = PyDict_New(), *fresh = PyList_New(0);
    if (rows == NULL || fresh == NULL) goto fail;
    for (size_t i = 0; i < l->count; i++) {
        item_t *item = &l->items[i];
        PyObject *name = PyUnicode_DecodeFSDefaultAndSize(l->names + item->name, item->length);
        if (name == NULL) goto fail;
        PyObject *entry = NULL;
        if (cached != Py_None) {
            entry = PyDict_GetItemWithError(cached, name); /* borrowed */
            if (entry == NULL && PyErr_Occurred()) {
                Py_DECREF(name);
                goto fail;
            }
        }
        int reuse = entry == NULL ? 0 : reusable(entry, &item->st, cutoff);
        if (reuse < 0) {
            Py_DECREF(name);
            goto fail;
        }
        int added;
        if (reuse) {
            added = PyDict_SetItem(rows, name, entry);
        } else {
            PyObject *st = stat_result_of(&item->st);
            PyObject *pair = st == NULL ? NULL : PyTuple_Pack(2, name, st);
            Py_XDECREF(st);
            added = pair == NULL ? -1 : PyList_Append(fresh, pair);
            Py_XDECREF(pair);
        }
        Py_DECREF(name);
        if (added < 0) goto fail;
    }
    PyObject *result = PyTuple_Pack(2, rows, fresh);
    Py_DECREF(rows);
    Py_DECREF(fresh);
    return result;
fail:
    Py_XDECREF(rows);
    Py_XDECREF(fresh);
    return NULL;
}

/* A few threads taking the items of one call in turn (the caller's thread is one of them). */
typedef struct {
    void (*run)(void *context, size_t i);
    void *context;
    size_t count;
    size_t next; /* taken with __atomic_fetch_add by each worker */
} pool_t;

static void *pool_work(void *arg) {
    pool_t *pool = arg;
    for (;;) {
        size_t i = __atomic_fetch_add(&pool->next, 1, __ATOMIC_RELAXED);
        if (i >= pool->count) break;
        pool->run(pool->context, i);
    }
    return NULL;
}

/* Without the GIL. A thread that cannot be started leaves its share to the others; a call
 * with few items runs on the caller's thread alone (starting one costs ~50-100 us). */
static void run_pool(pool_t *pool, int workers) {
    pthread_t threads[MAX_WORKERS];
    int started = 0;
    if (workers > MAX_WORKERS) workers = MAX_WORKERS;
    if ((size_t)workers > pool->count / MIN_ITEMS_PER_WORKER) {
        workers = (int)(pool->count / MIN_ITEMS_PER_WORKER);
    }
    for (int i = 1; i < workers; i++) {
        if (pthread_create(&threads[started], NULL, pool_work, pool) == 0) started++;
    }
    pool_work(pool);
    for (int i = 0; i < started; i++) pthread_join(threads[i], NULL);
}

typedef struct {
    int fd;
    int nomem;
    listing_t listing;
} job_t;

static void list_job(void *context, size_t i) {
    job_t *job = &((job_t *)context)[i];
    job->nomem = list_and_stat(job->fd, &job->listing);
}

PyDoc_STRVAR(scan_dirs_doc,
"scan_dirs(dirs, workers) -> list\n\n"
"For each (fd, cached, cutoff) of dirs: list the directory open at fd and lstat each entry\n"
"relative to it, on up to `workers` threads without the GIL. Each result is (rows, fresh),\n"
"or the OSError that directory raised (with the entry's name when it concerns one).\n"
"rows: name -> the cached Entry, for each file or symlink the stat cache vouches for\n"
"(cached: name -> Entry, or None; cutoff: the cached node's trusted_before_ns). fresh:\n"
"(name, os.stat_result) of every other entry, in no particular order. An entry gone before\n"
"its lstat is left out.");

static PyObject *scan_dirs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dirs;
    int workers;
    if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &dirs, &workers)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(dirs);
    job_t *jobs = calloc(count ? (size_t)count : 1, sizeof(job_t));
    PyObject **cacheds = calloc(count ? (size_t)count : 1, sizeof(PyObject *));
    long long *cutoffs = calloc(count ? (size_t)count : 1, sizeof(long long));
    PyObject *results = NULL;
    if (jobs == NULL || cacheds == NULL || cutoffs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(dirs, i);
        if (!PyArg_ParseTuple(item, "iOL", &jobs[i].fd, &cacheds[i], &cutoffs[i])) goto done;
        if (cacheds[i] != Py_None && !PyDict_Check(cacheds[i])) {
            PyErr_SetString(PyExc_TypeError, "cached must be a dict or None");
            goto done;
        }
    }
    pool_t pool = {list_job, jobs, (size_t)count, 0};
    Py_BEGIN_ALLOW_THREADS
    run_pool(&pool, workers < 1 ? 1 : workers);
    Py_END_ALLOW_THREADS
    results = PyList_New(count);
    if (results == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *result;
        if (jobs[i].nomem) {
            PyErr_NoMemory();
            result = NULL;
        } else {
            result = classify(&jobs[i].listing, cacheds[i], cutoffs[i]);
        }
        if (result == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_OSError)) {
                Py_CLEAR(results);
                goto done;
            }
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyErr_NormalizeException(&type, &value, &traceback);
            Py_XDECREF(type);
            Py_XDECREF(traceback);
            result = value;
        }
        PyList_SET_ITEM(results, i, result);
    }
done:
    if (jobs != NULL) {
        for (Py_ssize_t i = 0; i < count; i++) listing_free(&jobs[i].listing);
    }
    free(jobs);
    free(cacheds);
    free(cutoffs);
    return results;
}

/* -- reading small regular files ------------------------------------------------------------ */

typedef struct {
    int dir_fd;
    int proc_fd; /* /proc/self/fd, open: a reopen is one lookup in it, not a path walk */
    long long limit;
    const char *name;
    int ok;
    struct stat before, after;
    char *data;
    size_t length;
    int xattrs; /* 1: flistxattr listed a name (or failed): the scanner reads them by name */
} read_t;

/* Without the GIL: open the name without following (O_PATH), and only if fstat says it is a
 * regular file of at most `limit` bytes, reopen it for reading through /proc/self/fd, read it
 * (one byte past its size, to see growth), fstat it again. Anything else: ok = 0. */
static void read_job(void *context, size_t i) {
    read_t *r = &((read_t *)context)[i];
    r->ok = 0;
    int path_fd = openat(r->dir_fd, r->name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (path_fd < 0) return;
    if (fstat(path_fd, &r->before) != 0 || !S_ISREG(r->before.st_mode) ||
        r->before.st_size > r->limit) {
        close(path_fd);
        return;
    }
    char number[32];
    snprintf(number, sizeof number, "%d", path_fd);
    /* O_NOATIME: a scan reads every file of a first checkpoint, and each read of a file
     * written since it was last read would dirty its inode (relatime) for the journal to
     * commit; allowed for the file's owner and root, else read as anyone may. */
    int fd = openat(r->proc_fd, number, O_RDONLY | O_CLOEXEC | O_NOATIME);
    if (fd < 0 && errno == EPERM) fd = openat(r->proc_fd, number, O_RDONLY | O_CLOEXEC);
    close(path_fd);
    if (fd < 0) return;
    size_t room = (size_t)r->before.st_size + 1;
    r->data = malloc(room);
    size_t got = 0;
    while (r->data != NULL && got < room) {
        ssize_t n = read(fd, r->data + got, room - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            got = (size_t)-1;
            break;
        }
        if (n == 0) break;
        got += (size_t)n;
    }
    /* between the read and the second fstat: a setxattr after it moves the ctime, and the
     * scanner's torn check sees that */
    ssize_t listed = flistxattr(fd, NULL, 0);
    r->xattrs = listed > 0 || (listed < 0 && errno != ENOTSUP && errno != EOPNOTSUPP);
    if (r->data != NULL && got != (size_t)-1 && fstat(fd, &r->after) == 0) {
        r->length = got;
        r->ok = 1;
    }
    close(fd);
}

PyDoc_STRVAR(read_files_doc,
"read_files(dir_fd, names, limit, workers) -> list\n\n"
"Read each named regular file of at most `limit` bytes in the directory open at dir_fd, on\n"
"up to `workers` threads without the GIL: opened without following (O_PATH), checked with\n"
"fstat, reopened through /proc/self/fd, read up to one byte past its size, flistxattr'ed,\n"
"fstat again. Each result is (before, data, after, xattrs) (two os.stat_result, the bytes\n"
"read, and whether it has any extended attribute), or None for\n"
"anything else (gone, not a regular file, larger, unreadable): the caller reads those itself.");

/* The arguments of a read, made ready with the GIL: each name encoded (its bytes held until the
 * reads end), /proc/self/fd open. Returns 0, or -1 with an exception set. */
static int reads_prepare(int dir_fd, PyObject *names, long long limit, read_t **reads,
                         PyObject ***encoded, int *proc_fd) {
    Py_ssize_t count = PyList_GET_SIZE(names);
    *reads = calloc(count ? (size_t)count : 1, sizeof(read_t));
    *encoded = calloc(count ? (size_t)count : 1, sizeof(PyObject *));
    *proc_fd = -1;
    if (*reads == NULL || *encoded == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *proc_fd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*proc_fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, "/proc/self/fd");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        (*encoded)[i] = PyUnicode_EncodeFSDefault(PyList_GET_ITEM(names, i));
        if ((*encoded)[i] == NULL) return -1;
        (*reads)[i].dir_fd = dir_fd;
        (*reads)[i].proc_fd = *proc_fd;
        (*reads)[i].limit = limit;
        (*reads)[i].name = PyBytes_AS_STRING((*encoded)[i]);
    }
    return 0;
}

static void reads_free(read_t *reads, PyObject **encoded, Py_ssize_t count, int proc_fd) {
    if (proc_fd >= 0) close(proc_fd);
    for (Py_ssize_t i = 0; reads != NULL && encoded != NULL && i < count; i++) {
        free(reads[i].data);
        Py_XDECREF(encoded[i]);
    }
    free(reads);
    free(encoded);
}

/* The results of reads[start:end] as read_files returns them (each read's bytes freed). */
static PyObject *reads_results(read_t *reads, Py_ssize_t start, Py_ssize_t end) {
    PyObject *results = PyList_New(end - start);
    if (results == NULL) return NULL;
    for (Py_ssize_t i = start; i < end; i++) {
        PyObject *result;
        if (!reads[i].ok) {
            result = Py_NewRef(Py_None);
        } else {
            PyObject *before = stat_result_of(&reads[i].before);
            PyObject *data = PyBytes_FromStringAndSize(reads[i].data, (Py_ssize_t)reads[i].length);
            PyObject *after = stat_result_of(&reads[i].after);
            PyObject *xattrs = reads[i].xattrs ? Py_True : Py_False;
            result = before && data && after ? PyTuple_Pack(4, before, data, after, xattrs) : NULL;
            Py_XDECREF(before);
            Py_XDECREF(data);
            Py_XDECREF(after);
            if (result == NULL) { /* these results are lost: none is handed out twice */
                for (Py_ssize_t j = i; j < end; j++) {
                    free(reads[j].data);
                    reads[j].data = NULL;
                    reads[j].ok = 0;
                }
                Py_DECREF(results);
                return NULL;
            }
        }
        free(reads[i].data);
        reads[i].data = NULL;
        PyList_SET_ITEM(results, i - start, result);
    }
    return results;
}

static PyObject *read_files(PyObject *self, PyObject *args) {
    (void)self;
    int dir_fd, workers;
    long long limit;
    PyObject *names;
    if (!PyArg_ParseTuple(args, "iO!Li", &dir_fd, &PyList_Type, &names, &limit, &workers))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(names);
    read_t *reads = NULL;
    PyObject **encoded = NULL;
    PyObject *results = NULL;
    int proc_fd = -1;
    if (reads_prepare(dir_fd, names, limit, &reads, &encoded, &proc_fd) == 0) {
        pool_t pool = {read_job, reads, (size_t)count, 0};
        Py_BEGIN_ALLOW_THREADS
        run_pool(&pool, workers < 1 ? 1 : workers);
        Py_END_ALLOW_THREADS
        results = reads_results(reads, 0, count);
    }
    reads_free(reads, encoded, count, proc_fd);
    return results;
}

/* -- the same reads on a thread of their own, taken in order as they are done ---------------- */

typedef struct {
    read_t *reads;
    PyObject **encoded;
    Py_ssize_t count;
    int proc_fd;
    pthread_t thread;
    int running; /* a thread was started and not yet joined */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    Py_ssize_t done;  /* reads finished, under lock */
    Py_ssize_t taken; /* results handed out */
} pending_t;

#define PENDING_NAME "settled.workspace._walk.pending"

static void *pending_run(void *arg) {
    pending_t *p = arg;
    for (Py_ssize_t i = 0; i < p->count; i++) {
        read_job(p->reads, (size_t)i);
        pthread_mutex_lock(&p->lock);
        p->done = i + 1;
        pthread_cond_signal(&p->cond);
        pthread_mutex_unlock(&p->lock);
    }
    return NULL;
}

/* Wait (without the GIL) for the reads to end; nothing is read once this returns. */
static void pending_join(pending_t *p) {
    if (!p->running) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_join(p->thread, NULL);
    Py_END_ALLOW_THREADS
    p->running = 0;
}

static void pending_destroy(PyObject *capsule) {
    pending_t *p = PyCapsule_GetPointer(capsule, PENDING_NAME);
    if (p == NULL) return;
    if (p->running) { /* never taken to the end: its directory fd must outlive this join */
        pthread_join(p->thread, NULL);
        p->running = 0;
    }
    reads_free(p->reads, p->encoded, p->count, p->proc_fd);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->cond);
    free(p);
}

PyDoc_STRVAR(read_files_start_doc,
"read_files_start(dir_fd, names, limit) -> pending\n\n"
"The reads of read_files, in order on one thread of their own without the GIL, so that the\n"
"caller can hash what was read while the next files are read; read_files_take hands the\n"
"results out. The directory open at dir_fd must stay open until every result was taken (or\n"
"the pending object is gone: it waits for the thread before it goes).");

static PyObject *read_files_start(PyObject *self, PyObject *args) {
    (void)self;
    int dir_fd;
    long long limit;
    PyObject *names;
    if (!PyArg_ParseTuple(args, "iO!L", &dir_fd, &PyList_Type, &names, &limit)) return NULL;
    pending_t *p = calloc(1, sizeof(pending_t));
    if (p == NULL) return PyErr_NoMemory();
    p->count = PyList_GET_SIZE(names);
    p->proc_fd = -1;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->cond, NULL);
    PyObject *capsule = PyCapsule_New(p, PENDING_NAME, pending_destroy);
    if (capsule == NULL) {
        pthread_mutex_destroy(&p->lock);
        pthread_cond_destroy(&p->cond);
        free(p);
        return NULL;
    }
    if (reads_prepare(dir_fd, names, limit, &p->reads, &p->encoded, &p->proc_fd) != 0) {
        Py_DECREF(capsule);
        return NULL;
    }
    if (pthread_create(&p->thread, NULL, pending_run, p) == 0) {
        p->running = 1;
    } else { /* no thread to be had: read them all now, on this one */
        Py_BEGIN_ALLOW_THREADS
        pending_run(p);
        Py_END_ALLOW_THREADS
    }
    return capsule;
}

PyDoc_STRVAR(read_files_take_doc,
"read_files_take(pending, upto) -> list\n\n"
"The results of the reads not taken yet, up to the upto-th name (at most all of them), as\n"
"read_files returns them; waits without the GIL until they are read.");

static PyObject *read_files_take(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule;
    Py_ssize_t upto;
    if (!PyArg_ParseTuple(args, "On", &capsule, &upto)) return NULL;
    pending_t *p = PyCapsule_GetPointer(capsule, PENDING_NAME);
    if (p == NULL) return NULL;
    if (upto > p->count) upto = p->count;
    if (upto < p->taken) upto = p->taken;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    while (p->done < upto) pthread_cond_wait(&p->cond, &p->lock);
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    PyObject *results = reads_results(p->reads, p->taken, upto);
    p->taken = upto; /* taken even if they could not be handed out (the error is raised) */
    if (p->taken == p->count) pending_join(p);
    return results;
}

static PyMethodDef methods[] = {
    {"scan_dirs", scan_dirs, METH_VARARGS, scan_dirs_doc},
    {"read_files", read_files, METH_VARARGS, read_files_doc},
    {"read_files_start", read_files_start, METH_VARARGS, read_files_start_doc},
    {"read_files_take", read_files_take, METH_VARARGS, read_files_take_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "settled.workspace._walk",
    "The scanner's per-directory hot loop in C; settled.workspace.walk is its pure Python twin.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__walk(void) {
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL) return NULL;
    stat_result_type = PyObject_GetAttrString(os, "stat_result");
    Py_DECREF(os);
    if (stat_result_type == NULL) return NULL;
    return PyModule_Create(&module);
}
