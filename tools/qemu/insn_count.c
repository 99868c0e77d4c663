/* A qemu TCG plugin that counts the guest instructions a run retires, for
 * tools/arm_instruction_counts.py: at every translated block, an inline add of the block's
 * instruction count to one counter each time the block runs (no callback per instruction).
 * Printed to standard error at exit as "insn_count: N". Inline adds are not atomic: count
 * single-threaded guests (OpenMP with one thread).
 *
 * Written against the plugin API of qemu 4.2-8.x (QEMU_PLUGIN_VERSION 1: Debian 12's qemu-user
 * 7.2 loads it with -plugin); only the few functions used are declared here, as that API
 * documents them, so no qemu headers are needed to build it:
 *   cc -shared -fPIC -O2 insn_count.c -o libinsn_count.so */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define EXPORT __attribute__((visibility("default")))

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
struct qemu_info_t;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 = 0 };
typedef void (*tb_trans_cb)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*udata_cb)(qemu_plugin_id_t id, void *userdata);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_trans_cb cb);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr, uint64_t imm);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, udata_cb cb, void *userdata);

EXPORT int qemu_plugin_version = 1;

static uint64_t retired;

static void translated(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &retired, qemu_plugin_tb_n_insns(tb));
}

static void done(qemu_plugin_id_t id, void *userdata) {
    (void)id, (void)userdata;
    fprintf(stderr, "insn_count: %llu\n", (unsigned long long)retired);
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const struct qemu_info_t *info, int argc, char **argv) {
    (void)info, (void)argc, (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, translated);
    qemu_plugin_register_atexit_cb(id, done, NULL);
    return 0;
}
