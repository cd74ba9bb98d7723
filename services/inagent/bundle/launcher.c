/*
 * Launcher of the orchard-inagent bundle.
 *
 * Built static, so it runs in any Linux image: with no libc, no dynamic loader and no shell.
 * It finds the bundle's directory from its own path and replaces itself (same pid, so the
 * agent can be a sandbox's first process) with the bundle's own dynamic loader running the
 * frozen agent:
 *
 *   <dir>/lib/ld-linux-x86-64.so.2 --library-path <dir>/lib <dir>/lib/orchard-inagent-py ARGS
 *
 * Nothing is written anywhere, so the bundle works from a read-only mount and from any
 * working directory. The frozen agent sees argv[0] = <dir>/lib/orchard-inagent-py, which is
 * how PyInstaller's bootloader locates its files when /proc/self/exe names the loader.
 *
 * A one-dir PyInstaller bootloader normally re-executes itself once to apply LD_LIBRARY_PATH;
 * here --library-path already covers every library, so the launcher tells it (through its own
 * _PYI_* variables, as if the re-execution had happened) to go straight on. That saves an exec
 * and works without /proc, which the re-execution through the loader needs. Should a bootloader
 * not accept them, it re-executes as usual. The agent drops these variables at start
 * (rthook_environment.py), so the commands it runs never see them.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LOADER_NAME "ld-linux-x86-64.so.2"
#define FROZEN_NAME "orchard-inagent-py"
#define PROCESS_NAME "orchard-inagent"
/* PyInstaller 6 bootloader: the level of a one-dir main process before its re-execution. */
#define PYI_LEVEL_BEFORE_RESTART "-1"

/* The bundle's directory: from /proc/self/exe, else from argv[0] (when /proc is not mounted). */
static int bundle_dir(const char *argv0, char *out, size_t size) {
    char path[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
    if (n > 0) {
        path[n] = '\0';
    } else if (argv0 != NULL && strchr(argv0, '/') != NULL && realpath(argv0, path) != NULL) {
        /* realpath filled path */
    } else {
        return -1;
    }
    char *slash = strrchr(path, '/');
    if (slash == NULL) {
        return -1;
    }
    *slash = '\0';
    if (path[0] == '\0') {
        strcpy(path, "/");
    }
    if ((size_t)snprintf(out, size, "%s", path) >= size) {
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    char dir[PATH_MAX], lib[PATH_MAX], loader[PATH_MAX], frozen[PATH_MAX];
    if (bundle_dir(argc > 0 ? argv[0] : NULL, dir, sizeof(dir)) != 0) {
        fputs("orchard-inagent: cannot find the bundle directory (is /proc mounted?)\n", stderr);
        return 127;
    }
    if ((size_t)snprintf(lib, sizeof(lib), "%s/lib", dir) >= sizeof(lib) ||
        (size_t)snprintf(loader, sizeof(loader), "%s/" LOADER_NAME, lib) >= sizeof(loader) ||
        (size_t)snprintf(frozen, sizeof(frozen), "%s/" FROZEN_NAME, lib) >= sizeof(frozen)) {
        fputs("orchard-inagent: bundle path too long\n", stderr);
        return 127;
    }

    /* Best effort: if any of these fails, the bootloader simply re-executes itself. */
    if (setenv("_PYI_ARCHIVE_FILE", frozen, 1) != 0 ||
        setenv("_PYI_PARENT_PROCESS_LEVEL", PYI_LEVEL_BEFORE_RESTART, 1) != 0 ||
        setenv("_PYI_LINUX_PROCESS_NAME", PROCESS_NAME, 1) != 0) {
        unsetenv("_PYI_ARCHIVE_FILE");
        unsetenv("_PYI_PARENT_PROCESS_LEVEL");
    }

    int extra = argc > 1 ? argc - 1 : 0;
    char **args = calloc((size_t)extra + 5, sizeof(char *));
    if (args == NULL) {
        fputs("orchard-inagent: out of memory\n", stderr);
        return 127;
    }
    args[0] = loader;
    args[1] = "--library-path";
    args[2] = lib;
    args[3] = frozen;
    for (int i = 0; i < extra; i++) {
        args[4 + i] = argv[1 + i];
    }
    args[4 + extra] = NULL;

    execv(loader, args);
    fprintf(stderr, "orchard-inagent: cannot execute %s: %s\n", loader, strerror(errno));
    return 126;
}
