/* A qemu TCG plugin that counts the guest instructions a run retires, for
 * tools/arm_instruction_counts.py: at every translated block, an inline add of the block's
 * instruction count to one counter each time the block runs (no callback per instruction).
 * Printed to standard error at exit as "insn_count: N". Inline adds are not atomic: count
 * single-threaded guests (OpenMP with one thread).
 *
 * With the argument cache=BYTES (-plugin libinsn_count.so,cache=4194304) it also follows every
 * load and store through a simulated last-level cache of BYTES (64-byte lines, 16 ways, LRU,
 * write-allocate, physically the guest's virtual addresses) and prints at exit
 * "mem_bytes: B" (bytes the guest's loads and stores named) and "cache_miss_bytes: M" (64 x the
 * lines that missed: what a core behind such a cache would fetch from memory). A callback per
 * memory access: several times slower than counting alone.
 *
 * With profile=PATH it also counts each translated block's executions and writes PATH at exit:
 * qemu's own /proc/self/maps, a line "blocks", then "HOST_ADDRESS INSTRUCTIONS EXECUTIONS" per
 * block, the host address of the block's first instruction's bytes (the guest file mapped
 * into qemu), so tools/arm_llama_cpp_peer.py can name the function each block belongs to.
 *
 * Written against the plugin API of qemu 4.2-8.x (QEMU_PLUGIN_VERSION 1: Debian 12's qemu-user
 * 7.2 loads it with -plugin); only the few functions used are declared here, as that API
 * documents them, so no qemu headers are needed to build it:
 *   cc -shared -fPIC -O2 insn_count.c -o libinsn_count.so */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef uint64_t qemu_plugin_id_t;
typedef uint32_t qemu_plugin_meminfo_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
struct qemu_info_t;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 = 0 };
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS = 0 };
enum qemu_plugin_mem_rw { QEMU_PLUGIN_MEM_R = 1, QEMU_PLUGIN_MEM_W, QEMU_PLUGIN_MEM_RW };
typedef void (*tb_trans_cb)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*udata_cb)(qemu_plugin_id_t id, void *userdata);
typedef void (*mem_cb)(unsigned int vcpu_index, qemu_plugin_meminfo_t info, uint64_t vaddr, void *userdata);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_trans_cb cb);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr, uint64_t imm);
void qemu_plugin_register_vcpu_mem_cb(struct qemu_plugin_insn *insn, mem_cb cb, enum qemu_plugin_cb_flags flags,
                                      enum qemu_plugin_mem_rw rw, void *userdata);
void *qemu_plugin_insn_haddr(const struct qemu_plugin_insn *insn);
unsigned int qemu_plugin_mem_size_shift(qemu_plugin_meminfo_t info);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, udata_cb cb, void *userdata);

EXPORT int qemu_plugin_version = 1;

#define LINE 64
#define WAYS 16

static uint64_t retired, mem_bytes, misses;
static uint64_t *tags; /* sets x WAYS line numbers + 1 (0: empty), most recent first */
static uint64_t sets;

static void touch(uint64_t line) {
    uint64_t *set = tags + (line % sets) * WAYS, tag = line + 1;
    int way = 0;
    while (way < WAYS && set[way] != tag) way++;
    if (way == WAYS) {
        misses++;
        way = WAYS - 1; /* the least recent goes */
    }
    memmove(set + 1, set, sizeof *set * way);
    set[0] = tag;
}

struct block { uint64_t haddr, insns, execs; };
#define CHUNK 65536
static struct block *chunks[4096]; /* never moved: the inline adds point into them */
static size_t n_blocks;
static const char *profile_path;

static void accessed(unsigned int vcpu, qemu_plugin_meminfo_t info, uint64_t vaddr, void *userdata) {
    (void)vcpu, (void)userdata;
    uint64_t size = 1ull << qemu_plugin_mem_size_shift(info);
    mem_bytes += size;
    for (uint64_t line = vaddr / LINE; line <= (vaddr + size - 1) / LINE; line++) touch(line);
}

static void translated(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    size_t n = qemu_plugin_tb_n_insns(tb);
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &retired, n);
    if (profile_path && n && n_blocks < CHUNK * 4096) {
        if (!chunks[n_blocks / CHUNK]) chunks[n_blocks / CHUNK] = calloc(CHUNK, sizeof(struct block));
        struct block *b = chunks[n_blocks / CHUNK] + n_blocks % CHUNK;
        n_blocks++;
        b->haddr = (uint64_t)(uintptr_t)qemu_plugin_insn_haddr(qemu_plugin_tb_get_insn(tb, 0));
        b->insns = n;
        qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &b->execs, 1);
    }
    if (tags)
        for (size_t i = 0; i < n; i++)
            qemu_plugin_register_vcpu_mem_cb(qemu_plugin_tb_get_insn(tb, i), accessed, QEMU_PLUGIN_CB_NO_REGS,
                                             QEMU_PLUGIN_MEM_RW, NULL);
}

static void done(qemu_plugin_id_t id, void *userdata) {
    (void)id, (void)userdata;
    fprintf(stderr, "insn_count: %llu\n", (unsigned long long)retired);
    if (tags)
        fprintf(stderr, "mem_bytes: %llu\ncache_miss_bytes: %llu\n", (unsigned long long)mem_bytes,
                (unsigned long long)(misses * LINE));
    FILE *out = profile_path ? fopen(profile_path, "w") : NULL;
    if (out) {
        FILE *maps = fopen("/proc/self/maps", "r");
        char line[4096];
        while (maps && fgets(line, sizeof line, maps)) fputs(line, out);
        if (maps) fclose(maps);
        fputs("blocks\n", out);
        for (size_t i = 0; i < n_blocks; i++) {
            const struct block *b = chunks[i / CHUNK] + i % CHUNK;
            if (b->execs)
                fprintf(out, "%llx %llu %llu\n", (unsigned long long)b->haddr, (unsigned long long)b->insns,
                        (unsigned long long)b->execs);
        }
        fclose(out);
    }
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const struct qemu_info_t *info, int argc, char **argv) {
    (void)info;
    for (int i = 0; i < argc; i++)
        if (strncmp(argv[i], "profile=", 8) == 0) profile_path = argv[i] + 8;
        else if (strncmp(argv[i], "cache=", 6) == 0) {
            uint64_t bytes = strtoull(argv[i] + 6, NULL, 0);
            sets = bytes / LINE / WAYS;
            if (sets == 0 || !(tags = calloc(sets * WAYS, sizeof *tags))) {
                fprintf(stderr, "insn_count: cache=%s: not a cache size of at least %d bytes\n", argv[i] + 6,
                        LINE * WAYS);
                return 1;
            }
        }
    qemu_plugin_register_vcpu_tb_trans_cb(id, translated);
    qemu_plugin_register_atexit_cb(id, done, NULL);
    return 0;
}
