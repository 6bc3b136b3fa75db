// hipflash — umbrella header for C++ users.
#pragma once

#include "hipflash/errors.hpp"
#include "hipflash/forward.hpp"
#include "hipflash/backward.hpp"
#include "hipflash/kvcache.hpp"
#include "hipflash/merge.hpp"
#include "hipflash/numeric.hpp"
#include "hipflash/params.hpp"
#include "hipflash/types.hpp"
#include "hipflash/detail/selector.hpp"
