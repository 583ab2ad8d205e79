/* Arrival tags over kvring's C ABI, in one process with two tokened
 * engines: "decode" grants request slot 5's layer 2 the four blocks it
 * gave it, for the sender "prefill-c" only; "prefill-c" pushes that layer
 * tagged (kvring_push_layer_tagged) over tcp; decode waits for the bytes
 * (kvring_wait_landed) instead of a notification, and checks them. Also:
 * a wait before the push ends -TIMEOUT at its deadline, a second engine's
 * bytes under the same tag do not count for prefill-c, and bad input is
 * refused with the documented codes. Prints "arrivals ok" on success.
 */
#include "kvring.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LEN (1 << 20)
#define BLOCK (64 * 1024)
#define TOKEN "c-arrivals-token"

static void check(int rc, const char *what) {
    if (rc < 0) {
        fprintf(stderr, "%s failed: %s: %s\n", what, kvring_error_name(rc), kvring_last_error());
        exit(1);
    }
}

static void expect(int rc, const char *code, const char *what) {
    if (rc >= 0 || strcmp(kvring_error_name(rc), code) != 0) {
        fprintf(stderr, "%s: expected -%s, got %d (%s): %s\n", what, code, rc, rc < 0 ? kvring_error_name(rc) : "ok",
                kvring_last_error());
        exit(1);
    }
}

/* A prefill engine named `name` with `LEN` bytes of `fill`, its segment
 * to `addr` over tcp, and a submitter. */
static void prefill(const char *name, unsigned char fill, const char *addr, kvring_engine **engine, uint64_t *region,
                    unsigned char **memory, kvring_segment **segment, kvring_submitter **submitter) {
    check(kvring_engine_create_with_token(name, "127.0.0.1:0", 1, TOKEN, engine), "prefill engine");
    *memory = aligned_alloc(4096, LEN);
    memset(*memory, fill, LEN);
    check(kvring_register_memory(*engine, *memory, LEN, KVRING_MEMORY_HOST, region), "prefill register");
    check(kvring_open_segment(*engine, addr, KVRING_TRANSPORT_TCP, 10000, segment), "open decode over tcp");
    check(kvring_submitter_create(*engine, submitter), "submitter");
}

/* Pushes blocks 0..3 of `region` into decode's `theirs`, tagged for slot 5
 * layer 2, and waits for the batch. */
static void push(kvring_submitter *submitter, kvring_segment *segment, uint64_t region, uint64_t theirs) {
    kvring_block blocks[4];
    for (int i = 0; i < 4; i++) {
        blocks[i] = (kvring_block){region, theirs, (uint64_t)i * BLOCK, (uint64_t)i * BLOCK, BLOCK};
    }
    uint64_t batch = 0, bytes = 0;
    check(kvring_push_layer_tagged(submitter, segment, 2, 5, blocks, 4, 10000, &batch), "push_layer_tagged");
    check(kvring_wait(submitter, batch, 10000, &bytes), "the tagged push");
    if (bytes != 4 * BLOCK) {
        fprintf(stderr, "the tagged push moved %llu bytes\n", (unsigned long long)bytes);
        exit(1);
    }
}

int main(void) {
    kvring_engine *decode = NULL;
    check(kvring_engine_create_with_token("decode", "127.0.0.1:0", 1, TOKEN, &decode), "decode engine");
    unsigned char *kv = aligned_alloc(4096, LEN);
    memset(kv, 0, LEN);
    uint64_t kv_region = 0;
    check(kvring_register_memory(decode, kv, LEN, KVRING_MEMORY_HOST, &kv_region), "decode register");
    char addr[128];
    check(kvring_engine_control_addr(decode, addr, sizeof addr), "control addr");

    uint32_t tag = 0;
    check(kvring_arrival_tag(5, 2, &tag), "arrival_tag");
    if (tag != (5u << 12 | 2u)) {
        fprintf(stderr, "tag %#x\n", tag);
        return 1;
    }
    kvring_range granted = {kv_region, 0, 4 * BLOCK};
    check(kvring_grant_arrival(decode, "prefill-c", tag, &granted, 1), "grant_arrival");

    /* Nothing pushed yet: the wait ends at its deadline, typed. */
    expect(kvring_wait_landed(decode, "prefill-c", tag, 4 * BLOCK, 20), "TIMEOUT", "a wait before the push");

    /* Another engine pushes the same blocks under the same tag: not counted
     * for prefill-c. */
    kvring_engine *other = NULL;
    kvring_segment *other_segment = NULL;
    kvring_submitter *other_submitter = NULL;
    unsigned char *other_memory = NULL;
    uint64_t other_region = 0;
    prefill("prefill-other", 0x22, addr, &other, &other_region, &other_memory, &other_segment, &other_submitter);
    push(other_submitter, other_segment, other_region, kv_region);
    uint64_t landed = 1;
    check(kvring_landed(decode, "prefill-c", tag, &landed), "landed");
    if (landed != 0) {
        fprintf(stderr, "another engine's bytes counted for prefill-c: %llu\n", (unsigned long long)landed);
        return 1;
    }

    kvring_engine *engine = NULL;
    kvring_segment *segment = NULL;
    kvring_submitter *submitter = NULL;
    unsigned char *memory = NULL;
    uint64_t region = 0;
    prefill("prefill-c", 0x11, addr, &engine, &region, &memory, &segment, &submitter);
    push(submitter, segment, region, kv_region);
    check(kvring_wait_landed(decode, "prefill-c", tag, 4 * BLOCK, 10000), "wait_landed");
    for (size_t i = 0; i < 4 * BLOCK; i++) {
        if (kv[i] != 0x11) {
            fprintf(stderr, "byte %zu is %#x after wait_landed\n", i, kv[i]);
            return 1;
        }
    }

    /* Bad input: each refused with its code. */
    expect(kvring_grant_arrival(decode, "prefill-c", tag, &granted, 1), "INVALID_ARGUMENT", "the same grant twice");
    expect(kvring_grant_arrival(decode, NULL, 0, &granted, 1), "INVALID_ARGUMENT", "tag 0");
    expect(kvring_grant_arrival(decode, NULL, tag + 1, NULL, 1), "INVALID_ARGUMENT", "null ranges");
    expect(kvring_arrival_tag(0, 1, &tag), "INVALID_ARGUMENT", "slot 0");
    expect(kvring_arrival_tag(1, 4096, &tag), "INVALID_ARGUMENT", "layer 4096");
    expect(kvring_wait_landed(NULL, NULL, tag, 1, 10), "INVALID_ARGUMENT", "a null engine");
    expect(kvring_landed(decode, NULL, tag, NULL), "INVALID_ARGUMENT", "a null bytes_out");

    uint64_t forgotten = 0;
    check(kvring_forget_arrival(decode, "prefill-c", tag, &forgotten), "forget_arrival");
    if (forgotten != 4 * BLOCK) {
        fprintf(stderr, "forgot %llu bytes\n", (unsigned long long)forgotten);
        return 1;
    }

    kvring_submitter_free(submitter);
    kvring_segment_free(segment);
    kvring_engine_destroy(engine);
    kvring_submitter_free(other_submitter);
    kvring_segment_free(other_segment);
    kvring_engine_destroy(other);
    kvring_engine_destroy(decode);
    free(memory);
    free(other_memory);
    free(kv);
    printf("arrivals ok\n");
    return 0;
}
