/* The C ABI's configuration object: every kvring.toml key set by name,
 * with the same checks as the file and the environment. Without an
 * argument: bad keys and values refused with -INVALID_ARGUMENT naming
 * them, a config file and the environment applied, an RDMA choice that
 * cannot be honoured refused, and an engine started from the keys; prints
 * "config ok". With "rdma" (the fake libibverbs on LD_LIBRARY_PATH, its
 * fakeroce0 with a 16-entry GID table of which 9 is empty): the RoCE GID
 * index reaches the NIC, an empty one refused by index and a valid one
 * used; prints "config rdma ok".
 */
#define _POSIX_C_SOURCE 200809L
#include "kvring.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void check(int rc, const char *what) {
    if (rc < 0) {
        fprintf(stderr, "%s failed: %s: %s\n", what, kvring_error_name(rc), kvring_last_error());
        exit(1);
    }
}

/* `rc` is -`code` and the last error's message contains `words`. */
static void refused(int rc, const char *code, const char *words, const char *what) {
    if (rc >= 0 || strcmp(kvring_error_name(rc), code) != 0 || strstr(kvring_last_error(), words) == NULL) {
        fprintf(stderr, "%s: expected -%s saying \"%s\", got %d (%s): %s\n", what, code, words, rc,
                rc < 0 ? kvring_error_name(rc) : "ok", kvring_last_error());
        exit(1);
    }
}

static kvring_config *fresh(void) {
    kvring_config *config = NULL;
    check(kvring_config_create(&config), "kvring_config_create");
    check(kvring_config_set(config, "listen", "127.0.0.1:0"), "listen");
    return config;
}

static void keys_and_values(void) {
    kvring_config *config = fresh();
    refused(kvring_config_set(config, "lanse", "2"), "INVALID_ARGUMENT", "unknown key \"lanse\"", "a misspelt key");
    refused(kvring_config_set(config, "rdma_gid_index", "300"), "INVALID_ARGUMENT", "rdma_gid_index",
            "a GID index past 255");
    refused(kvring_config_set(config, "transports", "shm,verbs"), "INVALID_ARGUMENT", "transports",
            "an unknown transport");
    refused(kvring_config_set(NULL, "lanes", "1"), "INVALID_ARGUMENT", "config", "a null config");
    refused(kvring_config_set(config, NULL, "1"), "INVALID_ARGUMENT", "key", "a null key");

    /* A file, then the environment, each over what was set before. */
    char path[] = "/tmp/kvring-config-XXXXXX";
    int fd = mkstemp(path);
    FILE *file = fdopen(fd, "w");
    fputs("version = 1\nlanes = 2\nname = \"from-file\"\n", file);
    fclose(file);
    check(kvring_config_load_file(config, path), "load_file");
    file = fopen(path, "w");
    fputs("lanes = 2\n", file);
    fclose(file);
    refused(kvring_config_load_file(config, path), "INVALID_ARGUMENT", "no version", "a file without a version");
    remove(path);
    setenv("KVRING_LANSE", "2", 1);
    refused(kvring_config_load_env(config), "INVALID_ARGUMENT", "KVRING_LANSE", "a misspelt variable");
    unsetenv("KVRING_LANSE");
    setenv("KVRING_NAME", "from-env", 1);
    check(kvring_config_load_env(config), "load_env");
    unsetenv("KVRING_NAME");

    /* Devices named while RDMA is off: refused, never RDMA left off. */
    check(kvring_config_set(config, "rdma", "off"), "rdma off");
    check(kvring_config_set(config, "rdma_devices", "mlx5_0"), "rdma_devices");
    kvring_engine *engine = NULL;
    refused(kvring_engine_create_from_config(config, &engine), "INVALID_ARGUMENT", "rdma is off",
            "devices with rdma off");
    kvring_config_free(config);
    config = fresh();
    check(kvring_config_set(config, "transports", "tcp"), "transports");
    check(kvring_engine_create_from_config(config, &engine), "an engine from the config");
    kvring_config_free(config);
    char addr[64];
    check(kvring_engine_control_addr(engine, addr, sizeof addr), "control_addr");
    if (strncmp(addr, "127.0.0.1:", 10) != 0) {
        fprintf(stderr, "the engine listens on %s, not the configured 127.0.0.1\n", addr);
        exit(1);
    }
    kvring_engine_destroy(engine);
    refused(kvring_engine_create_from_config(NULL, &engine), "INVALID_ARGUMENT", "config", "a null config");
    printf("config ok\n");
}

/* An engine on the fake's fakeroce0 with GID index `index`. */
static int rdma_engine(const char *index, kvring_engine **engine) {
    kvring_config *config = fresh();
    check(kvring_config_set(config, "rdma", "on"), "rdma on");
    check(kvring_config_set(config, "rdma_devices", "fakeroce0"), "rdma_devices");
    check(kvring_config_set(config, "rdma_gid_index", index), "rdma_gid_index");
    int rc = kvring_engine_create_from_config(config, engine);
    kvring_config_free(config);
    return rc;
}

static void rdma_gid_index(void) {
    kvring_engine *engine = NULL;
    int rc = rdma_engine("9", &engine);
    if (rc >= 0 || strstr(kvring_last_error(), "GID index 9 is out of range") == NULL) {
        fprintf(stderr, "GID index 9 (empty): expected a refusal by index, got %d: %s\n", rc, kvring_last_error());
        exit(1);
    }
    check(rdma_engine("1", &engine), "an engine on GID index 1");
    kvring_engine_destroy(engine);
    printf("config rdma ok\n");
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "rdma") == 0) {
        rdma_gid_index();
    } else {
        keys_and_values();
    }
    return 0;
}
