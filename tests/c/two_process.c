/* Two processes over kvring's C ABI.
 *
 *   two_process target              serves 1 MiB of malloc'd memory; prints
 *                                   "addr=IP:PORT region=N"; then answers
 *                                   "check SEED LEN" lines with "ok" or
 *                                   "mismatch at I"; exits at end of input.
 *   two_process initiator ADDR      pushes 16 x 64 KiB over tcp, reads them
 *                                   back into other memory, compares, and
 *                                   checks that bad input is refused; its
 *                                   log callback must see both its engines
 *                                   start.
 */
#include "kvring.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LEN (1 << 20)
#define BLOCK (64 * 1024)
#define BLOCKS 16

static void check(int rc, const char *what) {
    if (rc < 0) {
        fprintf(stderr, "%s failed: %s: %s\n", what, kvring_error_name(rc), kvring_last_error());
        exit(1);
    }
}

/* What the log callback saw: every event, and engines starting (at info). */
static atomic_int logged, started;

/* Runs on kvring's threads, so it only counts (atomically). */
static void on_log(int level, const char *target, const char *message, void *user) {
    atomic_fetch_add(&logged, 1);
    if (user == (void *)&logged && level == KVRING_LOG_INFO && strncmp(target, "kvring", 6) == 0 &&
        strncmp(message, "engine started name=", 20) == 0) {
        atomic_fetch_add(&started, 1);
    }
}

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)((i * 7 + seed) & 0xff); }

static unsigned char *buffer(void) {
    unsigned char *memory = aligned_alloc(4096, LEN);
    if (memory == NULL) {
        perror("aligned_alloc");
        exit(1);
    }
    memset(memory, 0, LEN);
    return memory;
}

static int target(void) {
    kvring_engine *engine = NULL;
    // Both sides share the cluster's token (it is proven, never sent).
    check(kvring_engine_create_with_token("decode-c", "127.0.0.1:0", 1, "c-abi-token", &engine), "engine_create");
    unsigned char *memory = buffer();
    uint64_t region = 0;
    check(kvring_register(engine, memory, LEN, &region), "register");
    char addr[64];
    check(kvring_engine_control_addr(engine, addr, sizeof addr), "control_addr");
    printf("addr=%s region=%llu\n", addr, (unsigned long long)region);
    fflush(stdout);
    char line[128];
    while (fgets(line, sizeof line, stdin) != NULL) {
        unsigned seed = 0;
        size_t len = 0;
        if (sscanf(line, "check %u %zu", &seed, &len) != 2 || len > LEN) {
            printf("bad command\n");
        } else {
            size_t i = 0;
            while (i < len && memory[i] == pattern(i, seed)) i++;
            if (i == len) printf("ok\n");
            else printf("mismatch at %zu\n", i);
        }
        fflush(stdout);
    }
    check(kvring_unregister(engine, region), "unregister");
    kvring_engine_destroy(engine);
    free(memory);
    return 0;
}

static int initiator(const char *addr) {
    check(kvring_set_log_callback(on_log, (void *)&logged), "set_log_callback");
    kvring_engine *engine = NULL;
    // Without the token, the target refuses this engine's handshake.
    kvring_engine *stranger = NULL;
    kvring_segment *refused = NULL;
    check(kvring_engine_create("stranger-c", "127.0.0.1:0", 1, &stranger), "engine_create");
    int refusal = kvring_open_segment(stranger, addr, KVRING_TRANSPORT_TCP, 5000, &refused);
    if (refusal >= 0 || strcmp(kvring_error_name(refusal), "UNAUTHORIZED") != 0) {
        fprintf(stderr, "a tokenless engine opened a tokened target: %d %s\n", refusal, kvring_error_name(refusal));
        return 1;
    }
    kvring_engine_destroy(stranger);
    /* An allow-list no transport to this peer fits: refused with the reason. */
    kvring_engine *only_rdma = NULL;
    check(kvring_engine_create_with_transports("only-rdma-c", "127.0.0.1:0", 1, "c-abi-token", "rdma", &only_rdma),
          "engine_create_with_transports");
    refusal = kvring_open_segment(only_rdma, addr, KVRING_TRANSPORT_AUTO, 5000, &refused);
    if (refusal >= 0 || strcmp(kvring_error_name(refusal), "UNSUPPORTED") != 0 ||
        strstr(kvring_last_error(), "no allowed transport reaches decode-c: allowed rdma") == NULL) {
        fprintf(stderr, "an rdma-only engine opened a peer without rdma: %d %s\n", refusal, kvring_last_error());
        return 1;
    }
    kvring_engine_destroy(only_rdma);
    check(kvring_engine_create_with_token("prefill-c", "127.0.0.1:0", 1, "c-abi-token", &engine), "engine_create");
    unsigned char *source = buffer();
    unsigned char *back = buffer();
    for (size_t i = 0; i < LEN; i++) source[i] = pattern(i, 7);
    uint64_t local = 0, local_back = 0, remote = 0;
    check(kvring_register(engine, source, LEN, &local), "register");
    check(kvring_register_memory(engine, back, LEN, KVRING_MEMORY_HOST, &local_back), "register_memory");
    /* Where regions live: host memory here and on the peer. Host memory
       said to be a GPU's is refused (with a GPU driver, as host memory; without
       one, for want of a GPU provider), as is a memory number below -1. */
    if (kvring_region_memory(engine, local_back) != KVRING_MEMORY_HOST) {
        fprintf(stderr, "region_memory: not host memory\n");
        return 1;
    }
    /* A buffer no region covers, so that nothing but the memory kind can be
       the reason for a refusal (an overlap with `back` would refuse it too). */
    unsigned char *spare = buffer();
    uint64_t not_registered = 0;
    if (kvring_register_memory(engine, spare, 4096, 0, &not_registered) >= 0 ||
        strstr(kvring_last_error(), "GPU 0") == NULL) {
        fprintf(stderr, "register_memory: host memory registered as a GPU's, or refused for another reason: %s\n",
                kvring_last_error());
        return 1;
    }
    if (kvring_register_memory(engine, spare, 4096, -2, &not_registered) >= 0 ||
        strstr(kvring_last_error(), "is not -1 (host)") == NULL) {
        fprintf(stderr, "register_memory: memory -2 not refused as such: %s\n", kvring_last_error());
        return 1;
    }
    /* Told it is host memory, the same buffer registers. */
    check(kvring_register_memory(engine, spare, 4096, KVRING_MEMORY_HOST, &not_registered), "register_memory spare");
    kvring_segment *segment = NULL;
    check(kvring_open_segment(engine, addr, KVRING_TRANSPORT_TCP, 5000, &segment), "open_segment");
    check(kvring_segment_region(segment, 0, &remote), "segment_region");
    if (kvring_segment_region_memory(segment, 0) != KVRING_MEMORY_HOST || kvring_segment_region_memory(segment, 9) >= 0) {
        fprintf(stderr, "segment_region_memory: wrong answers\n");
        return 1;
    }
    kvring_submitter *sub = NULL;
    check(kvring_submitter_create(engine, &sub), "submitter_create");

    kvring_block blocks[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) {
        blocks[i] = (kvring_block){local, remote, (uint64_t)i * BLOCK, (uint64_t)i * BLOCK, BLOCK};
    }
    uint64_t batch = 0, bytes = 0;
    check(kvring_submit(sub, segment, KVRING_WRITE, blocks, BLOCKS, 42, 0, &batch), "submit write");
    check(kvring_wait(sub, batch, 10000, &bytes), "wait write");
    if (bytes != (uint64_t)BLOCKS * BLOCK) {
        fprintf(stderr, "wrote %llu bytes\n", (unsigned long long)bytes);
        return 1;
    }
    uint64_t written = batch;
    for (int i = 0; i < BLOCKS; i++) blocks[i].local_region = local_back;
    check(kvring_submit(sub, segment, KVRING_READ, blocks, BLOCKS, 43, 0, &batch), "submit read");
    if (kvring_batch_transport(sub, batch) != KVRING_TRANSPORT_TCP) {
        fprintf(stderr, "batch_transport: %d, not tcp\n", kvring_batch_transport(sub, batch));
        return 1;
    }
    kvring_completion done = {0};
    int reaped = 0;
    for (int spins = 0; spins < 10000000 && reaped == 0; spins++) {
        reaped = kvring_reap(sub, &done);
        check(reaped, "reap");
    }
    if (reaped != 1 || done.result != 0 || done.user_data != 43 || done.batch != batch ||
        done.transport != KVRING_TRANSPORT_TCP) {
        fprintf(stderr, "read completion: reaped %d result %d user_data %llu transport %d\n", reaped, done.result,
                (unsigned long long)done.user_data, done.transport);
        return 1;
    }
    if (memcmp(source, back, (size_t)BLOCKS * BLOCK) != 0) {
        fprintf(stderr, "read back differs\n");
        return 1;
    }

    /* Cancelling: a batch whose result was consumed is stale, an id never
       issued is unknown, and a batch cancelled at once ends cancelled (with
       at most its bytes moved) or done, nothing else. */
    int stale = kvring_cancel(sub, written);
    if (stale >= 0 || strcmp(kvring_error_name(stale), "STALE_BATCH") != 0) {
        fprintf(stderr, "cancel of a consumed batch: %d %s\n", stale, kvring_error_name(stale));
        return 1;
    }
    int unknown = kvring_cancel(sub, 0xdead0000beefULL);
    if (unknown >= 0 || strcmp(kvring_error_name(unknown), "UNKNOWN_BATCH") != 0) {
        fprintf(stderr, "cancel of a batch never issued: %d %s\n", unknown, kvring_error_name(unknown));
        return 1;
    }
    for (int i = 0; i < BLOCKS; i++) blocks[i].local_region = local;
    check(kvring_submit(sub, segment, KVRING_WRITE, blocks, BLOCKS, 44, 0, &batch), "submit to cancel");
    check(kvring_cancel(sub, batch), "cancel");
    bytes = 0;
    int cancelled = kvring_wait(sub, batch, 10000, &bytes);
    if (!(cancelled == 0 || strcmp(kvring_error_name(cancelled), "CANCELLED") == 0) ||
        bytes > (uint64_t)BLOCKS * BLOCK) {
        fprintf(stderr, "a cancelled batch ended %d %s after %llu bytes\n", cancelled, kvring_error_name(cancelled),
                (unsigned long long)bytes);
        return 1;
    }

    /* End-to-end checksums: a push the target verifies before it acks; a
       pull over tcp whose replies carry each block's CRC32C, verified here
       once landed; an unknown flag is refused. */
    check(kvring_submit_with(sub, segment, KVRING_WRITE, blocks, BLOCKS, 45, 0, KVRING_SUBMIT_CHECKSUM, &batch),
          "submit checksummed");
    check(kvring_wait(sub, batch, 10000, &bytes), "wait checksummed");
    for (int i = 0; i < BLOCKS; i++) blocks[i].local_region = local_back;
    memset(back, 0, (size_t)BLOCKS * BLOCK); /* before the submit: nothing moves yet */
    check(kvring_submit_with(sub, segment, KVRING_READ, blocks, BLOCKS, 46, 0, KVRING_SUBMIT_CHECKSUM, &batch),
          "submit checksummed read");
    int rc = kvring_wait(sub, batch, 10000, NULL);
    if (rc < 0 || memcmp(source, back, (size_t)BLOCKS * BLOCK) != 0) {
        fprintf(stderr, "checksummed tcp read: %d %s\n", rc, rc < 0 ? kvring_last_error() : "other bytes");
        return 1;
    }
    check(kvring_submit_with(sub, segment, KVRING_READ, blocks, BLOCKS, 47, 0, KVRING_SUBMIT_NO_CHECKSUM, &batch),
          "submit unchecked read");
    check(kvring_wait(sub, batch, 10000, NULL), "wait unchecked read");
    for (int i = 0; i < BLOCKS; i++) blocks[i].local_region = local;
    rc = kvring_submit_with(sub, segment, KVRING_WRITE, blocks, BLOCKS, 0, 0, 7, &batch);
    if (rc >= 0 || strstr(kvring_last_error(), "flags") == NULL) {
        fprintf(stderr, "bad flags: %d %s\n", rc, kvring_last_error());
        return 1;
    }
    if (strcmp(kvring_error_name(-26), "CORRUPT") != 0) {
        fprintf(stderr, "code 26 is %s, not CORRUPT\n", kvring_error_name(-26));
        return 1;
    }

    /* open_many: the same peer twice (one link, two handles) and an
       address nothing listens on, whose failure hides neither. */
    const char *names[3] = {addr, addr, "127.0.0.1:1"};
    kvring_segment *many[3] = {NULL, NULL, NULL};
    int codes[3] = {1, 1, 1};
    rc = kvring_open_many(engine, names, 3, KVRING_TRANSPORT_TCP, 5000, many, codes);
    if (rc >= 0 || many[0] == NULL || many[1] == NULL || codes[0] != 0 || codes[1] != 0 || many[2] != NULL ||
        codes[2] >= 0 || strstr(kvring_last_error(), "127.0.0.1:1") == NULL) {
        fprintf(stderr, "open_many: %d [%d %d %d] %s\n", rc, codes[0], codes[1], codes[2], kvring_last_error());
        return 1;
    }
    uint64_t many_remote = 0;
    check(kvring_segment_region(many[1], 0, &many_remote), "open_many segment_region");
    if (many_remote != remote) {
        fprintf(stderr, "open_many: region %llu, not %llu\n", (unsigned long long)many_remote, (unsigned long long)remote);
        return 1;
    }
    kvring_segment_free(many[0]);
    kvring_segment_free(many[1]);

    /* Bad input gets a clear error, never a crash. */
    kvring_block past_end = {local, remote, 0, LEN - 100, BLOCK};
    check(kvring_submit(sub, segment, KVRING_WRITE, &past_end, 1, 0, 0, &batch), "submit past end");
    rc = kvring_wait(sub, batch, 10000, NULL);
    if (rc >= 0 || strcmp(kvring_error_name(rc), "OUT_OF_BOUNDS") != 0) {
        fprintf(stderr, "past the end: %d %s\n", rc, kvring_error_name(rc));
        return 1;
    }
    rc = kvring_submit(sub, segment, 9, blocks, 1, 0, 0, &batch);
    if (rc >= 0 || strstr(kvring_last_error(), "opcode") == NULL) {
        fprintf(stderr, "bad opcode: %d %s\n", rc, kvring_last_error());
        return 1;
    }
    rc = kvring_open_segment(engine, NULL, 0, 1000, &segment);
    if (rc >= 0 || strstr(kvring_last_error(), "null") == NULL) {
        fprintf(stderr, "null name: %d %s\n", rc, kvring_last_error());
        return 1;
    }

    /* The stranger, the rdma-only engine and this one. */
    if (atomic_load(&started) != 3) {
        fprintf(stderr, "the log callback saw %d engine starts (of 3) in %d events\n", atomic_load(&started),
                atomic_load(&logged));
        return 1;
    }
    printf("pushed %d bytes, read back equal, bad input refused, %d events logged\n", BLOCKS * BLOCK,
           atomic_load(&logged));
    kvring_submitter_free(sub);
    kvring_segment_free(segment);
    kvring_engine_destroy(engine);
    check(kvring_set_log_callback(NULL, NULL), "set_log_callback(NULL)");
    free(source);
    free(back);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "target") == 0) return target();
    if (argc == 3 && strcmp(argv[1], "initiator") == 0) return initiator(argv[2]);
    fprintf(stderr, "usage: %s target | %s initiator ADDR\n", argv[0], argv[0]);
    return 2;
}
