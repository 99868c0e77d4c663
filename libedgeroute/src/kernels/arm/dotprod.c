/* The dotprod kernels (Armv8.2 SDOT and fp16: Neoverse N1, the Cortex-A78AE of Jetson Orin):
 * one SDOT by element multiplies 4 codes of 4 packed rows by 4 broadcast activations. */
#define TIER_TABLE er_dotprod_kernels
#define TIER_ID ER_KERNELS_DOTPROD

#include <arm_neon.h>

#include "dotprod.h"
#include "arm.h"
