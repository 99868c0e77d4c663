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
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const struct qemu_info_t *info, int argc, char **argv) {
    (void)info;
    for (int i = 0; i < argc; i++)
        if (strncmp(argv[i], "cache=", 6) == 0) {
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
