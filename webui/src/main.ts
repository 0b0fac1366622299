import { createApp } from "vue";
import App from "./App.vue";
import { Scope } from "./state/scope";
import { SCOPE_KEY } from "./state/use";
import "./styles.css";

const scope = new Scope(location.href, (clean) => history.replaceState(history.state, "", clean));
const app = createApp(App);
app.provide(SCOPE_KEY, scope);
app.mount("#app");
scope.start();
// For tests and the curious: the page's state, read-only by convention.
(window as unknown as { megascope: Scope }).megascope = scope;
