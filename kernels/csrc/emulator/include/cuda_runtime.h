// The emulator's stand-in for CUDA's runtime header (see emu.h).
#pragma once
#include "emu.h"
