/* Fenced destinations over kvring's C ABI, in one process: "decode"
 * fences a request's four blocks and hands the grant to "prefill", which
 * pushes them over tcp naming it (kvring_submit_granted); the request is
 * aborted and the blocks fenced again for another one; a push under the
 * old grant ends -FENCED and nothing of it lands; the new grant lands.
 * Bad input is refused with its code. Prints "fence ok" on success.
 */
#include "kvring.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LEN (1 << 20)
#define BLOCK (64 * 1024)

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

/* Pushes blocks 0..3 of `region` into `theirs` naming `grant`; returns
 * kvring_wait's code. */
static int push(kvring_submitter *submitter, kvring_segment *segment, uint64_t region, uint64_t theirs,
                uint32_t grant) {
    kvring_block blocks[4];
    for (int i = 0; i < 4; i++) {
        blocks[i] = (kvring_block){region, theirs, (uint64_t)i * BLOCK, (uint64_t)i * BLOCK, BLOCK};
    }
    uint64_t batch = 0, bytes = 0;
    check(kvring_submit_granted(submitter, segment, blocks, 4, 0, 10000, grant, &batch), "submit_granted");
    return kvring_wait(submitter, batch, 10000, &bytes);
}

static void expect_bytes(const unsigned char *kv, unsigned char byte, const char *what) {
    for (size_t i = 0; i < 4 * BLOCK; i++) {
        if (kv[i] != byte) {
            fprintf(stderr, "%s: byte %zu is %#x, not %#x\n", what, i, kv[i], byte);
            exit(1);
        }
    }
}

int main(void) {
    kvring_engine *decode = NULL;
    check(kvring_engine_create("decode", "127.0.0.1:0", 1, &decode), "decode engine");
    unsigned char *kv = aligned_alloc(4096, LEN);
    memset(kv, 0, LEN);
    uint64_t kv_region = 0;
    check(kvring_register_memory(decode, kv, LEN, KVRING_MEMORY_HOST, &kv_region), "decode register");
    char addr[128];
    check(kvring_engine_control_addr(decode, addr, sizeof addr), "control addr");

    kvring_engine *prefill = NULL;
    check(kvring_engine_create("prefill", "127.0.0.1:0", 1, &prefill), "prefill engine");
    unsigned char *memory = aligned_alloc(4096, LEN);
    memset(memory, 0x11, LEN);
    uint64_t region = 0;
    check(kvring_register_memory(prefill, memory, LEN, KVRING_MEMORY_HOST, &region), "prefill register");
    kvring_segment *segment = NULL;
    check(kvring_open_segment(prefill, addr, KVRING_TRANSPORT_TCP, 10000, &segment), "open decode over tcp");
    kvring_submitter *submitter = NULL;
    check(kvring_submitter_create(prefill, &submitter), "submitter");

    uint32_t old = 0, fresh = 0;
    check(kvring_fence(decode, kv_region, 0, 4 * BLOCK, &old), "fence");
    check(push(submitter, segment, region, kv_region, old), "a push under its grant");
    expect_bytes(kv, 0x11, "the granted push");

    /* The request is aborted; its blocks go to another one. */
    check(kvring_fence(decode, kv_region, 0, 4 * BLOCK, &fresh), "fence again");
    if (fresh <= old) {
        fprintf(stderr, "grant %u after %u\n", fresh, old);
        return 1;
    }
    memset(kv, 0xEE, 4 * BLOCK);
    expect(push(submitter, segment, region, kv_region, old), "FENCED", "a push under a stale grant");
    expect_bytes(kv, 0xEE, "after the stale push");
    check(push(submitter, segment, region, kv_region, fresh), "a push under the new grant");
    expect_bytes(kv, 0x11, "the new grant's push");

    /* Bad input: each refused with its code. */
    expect(kvring_fence(decode, kv_region, LEN, 1, &old), "OUT_OF_BOUNDS", "past the region");
    expect(kvring_fence(decode, kv_region, 0, 1, NULL), "INVALID_ARGUMENT", "a null grant_out");
    expect(kvring_fence(NULL, kv_region, 0, 1, &old), "INVALID_ARGUMENT", "a null engine");

    kvring_submitter_free(submitter);
    kvring_segment_free(segment);
    kvring_engine_destroy(prefill);
    kvring_engine_destroy(decode);
    free(memory);
    free(kv);
    printf("fence ok\n");
    return 0;
}
