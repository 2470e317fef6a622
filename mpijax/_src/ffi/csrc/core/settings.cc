#include "core/settings.h"

namespace mpijax::detail {

Settings g_settings;

}  // namespace mpijax::detail
